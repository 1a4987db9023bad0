""":class:`ObjectStore`: checkpoints under an fsspec URL (``s3://bucket/run``, ``memory://``,
``file://``). A checkpoint is committed by its ``metadata.json`` object (``store.py``); a
manager folder holds ``step-N`` prefixes and is held by one job through a lease object
(``lease.py``)."""

from __future__ import annotations

import logging
import uuid
from typing import Any, Dict, List, Optional

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.metadata import METADATA_FILE, Metadata
from hyper_parallel.core.distributed_checkpoint.object_store import lease, store
from hyper_parallel.core.distributed_checkpoint.object_store.conditional import object_ops
from hyper_parallel.core.distributed_checkpoint.object_store.reader import FsspecReader
from hyper_parallel.core.distributed_checkpoint.object_store.writer import FsspecWriter
from hyper_parallel.utils.fileio import redact_url
from hyper_parallel.core.distributed_checkpoint.storage import CheckpointStore, checkpoint_step

_log = logging.getLogger(__name__)


class ObjectStore(CheckpointStore):
    """Checkpoints under ``url`` (a checkpoint's prefix, or a folder of ``step-N`` prefixes).

    Args:
        storage_options: fsspec options of the file system (on top of its own configuration).

    Raises:
        ValueError: ``url`` has no scheme fsspec knows, or its implementation is not installed.
    """

    lock_can_be_lost = True

    def __init__(self, url: str, storage_options: Optional[Dict[str, Any]] = None) -> None:
        self.location = url.rstrip("/")
        self.storage_options = storage_options
        self.fs, self.path = store.open_store(self.location, storage_options)
        self._held = False

    def writer(self) -> FsspecWriter:
        return FsspecWriter(self.location, storage_options=self.storage_options)

    def reader(self, *, verify: bool = True) -> FsspecReader:
        return FsspecReader(self.location, verify=verify, storage_options=self.storage_options)

    def is_checkpoint(self) -> bool:
        return store.is_committed(self.fs, self.path)

    def read_metadata(self) -> Metadata:
        return store.read_metadata(self.fs, self.path, self.location)

    def verify(self, *, allow_pickle: bool = False) -> Metadata:
        return store.verify_objects(self.fs, self.path, self.location, allow_pickle)

    def child(self, name: str) -> ObjectStore:
        child = type(self).__new__(type(self))  # on the same file system: nothing to resolve again
        child.location, child.storage_options = f"{self.location}/{name}", self.storage_options
        child.fs, child.path, child._held = self.fs, f"{self.path}/{name}", False
        return child

    def names(self) -> List[str]:
        return store.list_names(self.fs, self.path)

    # --- one job per folder (lease.py) -----------------------------------------------------

    def hold(self) -> Optional[str]:
        """Take the folder's lease for this process, then remove what killed saves left
        (nothing of this job is in flight yet). Read-only access (e.g. only to resume from)
        works unlocked, with a warning, as for a read-only directory."""
        try:
            refusal = lease.acquire_folder(object_ops(self.fs), self.path, self.location)
        except PermissionError as exc:
            _log.warning("cannot lock %s (%s): a second job on this folder would not be detected", self.location, exc)
            return None
        except OSError as exc:  # the store refused the lock object itself (endpoint, bucket)
            return f"cannot lock checkpoint folder {self.location}: {exc}"
        if refusal is None:
            self._held = True
            self._remove_abandoned_uploads()
        return refusal

    def release(self) -> None:
        if self._held:
            self._held = False
            lease.release_folder(self.location)

    def lock_problem(self) -> Optional[str]:
        return lease.lease_problem(self.location)

    def confirm_lock(self, doing: str) -> Optional[str]:
        """The lease confirmed with the store now (a renewal conditional on its ETag,
        ``lease.fence``): a job taken over while it was stalled learns it here."""
        try:
            lease.fence(self.location, doing)
        except CheckpointError as exc:
            return str(exc)
        return None

    # --- abandoned uploads ----------------------------------------------------------------

    def _is_step_upload(self, key: str) -> bool:
        """``key`` (relative to the folder) is a save's data or marker object in a step-N prefix."""
        prefix, _, name = key.partition("/")
        return checkpoint_step(prefix) is not None and store.save_id_of(name) is not None

    def after_commit(self) -> None:
        """Abort the incomplete multipart uploads of saves under the ``step-N`` prefixes (S3):
        a failed save's, which its own cleanup cannot list as objects."""
        object_ops(self.fs).abort_uploads(self.path, self._is_step_upload)

    def _remove_abandoned_uploads(self) -> None:
        """Delete the save-tagged objects of uncommitted ``step-N`` prefixes (uploads of saves
        killed before their commit) and abort the incomplete multipart uploads of saves.
        Objects of other names are left alone."""
        for step in sorted(s for s in map(checkpoint_step, self.names()) if s is not None):
            prefix = self.step(step)
            if not prefix.is_checkpoint():
                store.remove_saves(self.fs, prefix.path, lambda save_id: True)
        self.after_commit()

    def remove(self) -> None:
        """Delete the metadata object first (it stops being a checkpoint at once), then
        everything under the prefix."""
        self.fs.rm(f"{self.path}/{METADATA_FILE}")
        self.fs.invalidate_cache(self.path)
        if self.fs.exists(self.path):
            self.fs.rm(self.path, recursive=True)

    def write_problem(self, name: str) -> Optional[str]:
        """Write (then delete) a probe object: credentials, endpoint and bucket are checked.
        Within :func:`~..stores.startup_bounds` each call ends in bounded time, and a store
        that does not answer is one line naming its endpoint."""
        probe = f"{self.path}/.hyper_parallel.preflight.{uuid.uuid4().hex}"
        try:
            self.fs.pipe_file(probe, b"", **store.call_deadline(self.fs))
            self.fs.rm(probe, **store.call_deadline(self.fs))
        except store.unreachable_errors() as err:  # refused, reset, or no answer within the bounds
            return f"{name}: {store.unreachable_message(self.location, err)}"
        except Exception as err:  # noqa: BLE001 (credentials, endpoint, bucket: whatever the store says)
            return (f"{name}={redact_url(self.location)} cannot be written ({type(err).__name__}: {err}); check "
                    "the bucket, the endpoint (AWS_ENDPOINT_URL) and the credentials")
        return None
