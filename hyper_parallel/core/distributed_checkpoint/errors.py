"""The checkpoint package's error type, imported by every layer below the public face."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or not loadable into the given state."""
