"""A :class:`CheckpointManager` folder under an fsspec URL: ``step-N`` prefixes, committed
when their ``metadata.json`` object exists (``store.py``)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from hyper_parallel.core.distributed_checkpoint.format.metadata import METADATA_FILE
from hyper_parallel.core.distributed_checkpoint.object_store import store


class ObjectFolder:
    """The ``step-N`` checkpoints under ``url``; ``step_of(name)`` parses a prefix name."""

    def __init__(self, url: str, step_of: Callable[[str], Optional[int]],
                 storage_options: Optional[Dict[str, Any]] = None) -> None:
        self.url = url.rstrip("/")
        self.fs, self.path = store.open_store(self.url, storage_options)
        self._step_of = step_of

    def step_url(self, step: int) -> str:
        return f"{self.url}/step-{step}"

    def _steps(self) -> List[int]:
        steps = (self._step_of(name) for name in store.list_names(self.fs, self.path))
        return sorted(s for s in steps if s is not None)

    def committed_steps(self) -> List[int]:
        """Steps whose metadata object exists, ascending (one request per step-N prefix)."""
        return [s for s in self._steps() if store.is_committed(self.fs, f"{self.path}/step-{s}")]

    def remove_abandoned_uploads(self) -> None:
        """Delete the save-tagged objects of uncommitted ``step-N`` prefixes (uploads of saves
        killed before their commit; call only while none of this job's saves is in flight).
        Objects of other names are left alone."""
        for step in self._steps():
            prefix = f"{self.path}/step-{step}"
            names = store.list_names(self.fs, prefix)
            if METADATA_FILE not in names:
                ours = [f"{prefix}/{n}" for n in names if store.save_id_of(n) is not None]
                if ours:
                    self.fs.rm(ours)

    def remove(self, step: int) -> None:
        """Delete checkpoint ``step``: its metadata object first (it stops being a checkpoint
        at once), then everything under its prefix."""
        prefix = f"{self.path}/step-{step}"
        self.fs.rm(f"{prefix}/{METADATA_FILE}")
        self.fs.invalidate_cache(prefix)
        if self.fs.exists(prefix):
            self.fs.rm(prefix, recursive=True)
