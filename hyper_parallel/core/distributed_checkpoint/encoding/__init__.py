"""A save's bytes in the checkpoint format, whatever stores them: a rank's data files
(safetensors streamed from a :class:`~..storage.ChunkSource`, values files) and its write
results as JSON (the async commit's "done" markers). Both backends write these; neither
imports the other.

May import ``format`` and the package's contracts (``storage``, ``errors``) only.
"""
