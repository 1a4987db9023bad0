""":class:`LocalStore`: checkpoints as directories on a file system (local or mounted). A
checkpoint is committed by its metadata file (``commit.py``); a manager folder holds
``step-N`` directories and is held by one job through ``flock`` (``folder_lock.py``)."""

from __future__ import annotations

import os
import shutil
from typing import List, Optional

from hyper_parallel.core.distributed_checkpoint._fileio import local_path
from hyper_parallel.core.distributed_checkpoint.filesystem import commit
from hyper_parallel.core.distributed_checkpoint.filesystem.folder_lock import lock_folder, unlock_folder
from hyper_parallel.core.distributed_checkpoint.filesystem.reader import FileSystemReader
from hyper_parallel.core.distributed_checkpoint.filesystem.writer import FileSystemWriter
from hyper_parallel.core.distributed_checkpoint.format.metadata import Metadata
from hyper_parallel.core.distributed_checkpoint.storage import CheckpointStore, checkpoint_step
from hyper_parallel.utils.fileio import unusable_folder


class LocalStore(CheckpointStore):
    """Checkpoints under the file system path ``path`` (a checkpoint directory, or a folder of
    ``step-N`` ones).

    Raises:
        ValueError: ``path`` is a URL (``s3://...``): it would become a local folder ``s3:``.
    """

    def __init__(self, path: str) -> None:
        self.location = local_path(path)
        self._held = False

    def writer(self) -> FileSystemWriter:
        return FileSystemWriter(self.location)

    def reader(self, *, verify: bool = True) -> FileSystemReader:
        return FileSystemReader(self.location, verify=verify)

    def is_checkpoint(self) -> bool:
        return commit.is_checkpoint(self.location)

    def read_metadata(self) -> Metadata:
        return commit.read_checkpoint_metadata(self.location)

    def verify(self, *, allow_pickle: bool = False) -> Metadata:
        return commit.verify_checkpoint(self.location, allow_pickle=allow_pickle)

    def child(self, name: str) -> LocalStore:
        return LocalStore(os.path.join(self.location, name))

    def names(self) -> List[str]:
        return os.listdir(self.location) if os.path.isdir(self.location) else []

    def hold(self) -> Optional[str]:
        """Create the folder and take its ``flock``; then, holding it with nothing of this job
        written yet, remove the pending directories of ``step-N`` (crashed runs' saves)."""
        try:
            os.makedirs(self.location, exist_ok=True)
            refusal = lock_folder(self.location)
        except OSError as exc:  # told to every rank by the manager instead of leaving them waiting
            return f"cannot use checkpoint folder {self.location}: {exc}"
        if refusal is not None:
            return refusal
        self._held = True  # until release(): the OS also drops the lock when the process ends
        for name in os.listdir(self.location):
            target = commit.pending_target(name)
            if target is not None and checkpoint_step(target) is not None:
                shutil.rmtree(os.path.join(self.location, name), ignore_errors=True)
        return None

    def release(self) -> None:
        if self._held:
            self._held = False
            unlock_folder(self.location)

    def remove(self) -> None:
        shutil.rmtree(self.location, ignore_errors=True)

    def write_problem(self, name: str) -> Optional[str]:
        why = unusable_folder(self.location)
        return f"{name}={self.location} cannot be used: {why}; choose another {name}" if why else None
