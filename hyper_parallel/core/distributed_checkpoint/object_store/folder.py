"""A :class:`CheckpointManager` folder under an fsspec URL: ``step-N`` prefixes, committed
when their ``metadata.json`` object exists (``store.py``), held by one job (``lease.py``)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from hyper_parallel.core.distributed_checkpoint.format.metadata import METADATA_FILE
from hyper_parallel.core.distributed_checkpoint.object_store import lease, store
from hyper_parallel.core.distributed_checkpoint.object_store.conditional import object_ops


class ObjectFolder:
    """The ``step-N`` checkpoints under ``url``; ``step_of(name)`` parses a prefix name."""

    def __init__(self, url: str, step_of: Callable[[str], Optional[int]],
                 storage_options: Optional[Dict[str, Any]] = None) -> None:
        self.url = url.rstrip("/")
        self.fs, self.path = store.open_store(self.url, storage_options)
        self.ops = object_ops(self.fs)
        self._step_of = step_of

    def step_url(self, step: int) -> str:
        return f"{self.url}/step-{step}"

    def _steps(self) -> List[int]:
        steps = (self._step_of(name) for name in store.list_names(self.fs, self.path))
        return sorted(s for s in steps if s is not None)

    def committed_steps(self) -> List[int]:
        """Steps whose metadata object exists, ascending (one request per step-N prefix)."""
        return [s for s in self._steps() if store.is_committed(self.fs, f"{self.path}/step-{s}")]

    # --- one job per folder (lease.py) -----------------------------------------------------

    def lock(self) -> Optional[str]:
        """Take the folder's lease for this process; None, or a sentence naming the holder."""
        return lease.acquire_folder(self.ops, self.path, self.url)

    def unlock(self) -> None:
        lease.release_folder(self.url)

    def lock_problem(self) -> Optional[str]:
        """Why this process no longer holds the folder (its lease was lost), or None."""
        return lease.lease_problem(self.url)

    def fence(self, doing: str) -> None:
        """Confirm this process's lease of the folder before ``doing`` (``lease.fence``).

        Raises:
            CheckpointError: another job holds the folder now.
        """
        lease.fence(self.url, doing)

    # --- abandoned uploads ----------------------------------------------------------------

    def _is_step_upload(self, key: str) -> bool:
        """``key`` (relative to the folder) is a save's data or marker object in a step-N prefix."""
        prefix, _, name = key.partition("/")
        return self._step_of(prefix) is not None and store.save_id_of(name) is not None

    def abort_incomplete_uploads(self) -> int:
        """Abort the incomplete multipart uploads of saves under the ``step-N`` prefixes (S3;
        call only while none of this job's saves is in flight); how many."""
        return self.ops.abort_uploads(self.path, self._is_step_upload)

    def remove_abandoned_uploads(self) -> None:
        """Delete the save-tagged objects of uncommitted ``step-N`` prefixes (uploads of saves
        killed before their commit) and abort the incomplete multipart uploads of saves (call
        only while none of this job's saves is in flight). Objects of other names are left alone."""
        for step in self._steps():
            prefix = f"{self.path}/step-{step}"
            if not store.is_committed(self.fs, prefix):
                store.remove_saves(self.fs, prefix, lambda save_id: True)
        self.abort_incomplete_uploads()

    def remove(self, step: int) -> None:
        """Delete checkpoint ``step``: its metadata object first (it stops being a checkpoint
        at once), then everything under its prefix."""
        prefix = f"{self.path}/step-{step}"
        self.fs.rm(f"{prefix}/{METADATA_FILE}")
        self.fs.invalidate_cache(prefix)
        if self.fs.exists(prefix):
            self.fs.rm(prefix, recursive=True)
