"""CheckpointManager: periodic saves to ``folder/step-{N}``, retention, resume from the latest."""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from hyper_parallel.core.distributed_checkpoint import api
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.metadata import METADATA_FILE
from hyper_parallel.core.distributed_checkpoint.host_memory.background import AsyncSaveFuture
from hyper_parallel.core.distributed_checkpoint.stores import store_for
from hyper_parallel.platform import get_platform

__all__ = ["CheckpointManager", "committed_steps", "resolve_checkpoint"]

_log = logging.getLogger(__name__)


def committed_steps(folder: Union[str, os.PathLike]) -> List[int]:
    """Steps of the committed ``step-N`` checkpoints in ``folder`` (a directory or an fsspec
    URL), ascending (pending/partial dirs and uncommitted prefixes ignored).

    Raises:
        ValueError: ``folder`` is a URL of a scheme fsspec does not know.
    """
    return store_for(folder).committed_steps()


def resolve_checkpoint(path: Union[str, os.PathLike]) -> str:
    """``path`` if it is a committed checkpoint, else the newest committed ``step-N`` in it
    (a :class:`CheckpointManager` folder); ``path`` may be an fsspec URL. A location holding
    neither is returned as it is when it has metadata files (reading it then names what is
    wrong with them).

    Raises:
        CheckpointError: ``path`` is neither a checkpoint nor a folder of committed ones.
        ValueError: ``path`` is a URL of a scheme fsspec does not know.
    """
    path = os.fspath(path)
    store = store_for(path)
    if store.is_checkpoint():
        return path
    steps = store.committed_steps()
    if steps:
        return store.step(steps[-1]).location
    if any(name.startswith("metadata.") for name in store.names()):
        return path
    raise CheckpointError(f"{path} is not a committed checkpoint ({METADATA_FILE} is missing) nor a folder "
                          "holding committed step-N checkpoints")


class CheckpointManager:
    """Saves every ``interval`` steps into ``folder/step-{N}`` and keeps the newest ``keep_last_n``.

    ``state`` (for ``save`` and ``load_latest``) maps names to tensors, plain values or
    Stateful objects (``state_dict()`` / ``load_state_dict()``, e.g. :class:`ModelState`,
    :class:`OptimizerState`). All ranks call every method; without a process group the
    manager works single-process. Rank 0 deletes old checkpoints (shared file system).

    One job per folder: rank 0 holds an exclusive lock on ``folder/.hyper_parallel.lock``
    (``flock``, released by :meth:`close`, when the manager is garbage-collected or when the
    process ends), so a second job's
    manager is refused instead of deleting the first's staging directories or replacing its
    ``step-N``. Managers within one process share the lock.

    ``folder`` may be an fsspec URL (``s3://bucket/run``): checkpoints are then committed by
    their metadata object, the lock is a lease object renewed in the background (taken over
    from a job that stopped renewing it; ``object_store/lease.py``), rank 0 deletes the uploads
    that killed saves left in uncommitted ``step-N`` prefixes when the manager starts, and
    aborts incomplete multipart uploads of saves then and after each commit
    (docs/checkpoint.md, "Object storage").

    Args:
        folder: directory holding the ``step-{N}`` checkpoints (created if missing), or an fsspec URL.
        interval: ``save(step, ...)`` writes when ``step % interval == 0``.
        keep_last_n: committed checkpoints to keep (None: keep all). Deletion happens only
            after a new checkpoint committed; the newest one is never deleted.
        async_save: ``save`` returns a Future right after staging; the write runs in the
            background and ``wait()`` blocks until it committed.
        stage_in_background: with ``async_save``, ``save`` returns right after planning and
            the staging copy runs in the background (``hdcp.async_save``'s argument): the
            optimizers in ``state`` wait for it in ``step()``; other in-place updates of the
            saved tensors call :meth:`wait_for_staging` first.

    Raises:
        ValueError: ``interval < 1``, ``keep_last_n < 1``, ``stage_in_background``
            without ``async_save``, or ``folder`` is a URL fsspec does not know.
        CheckpointError: another job's manager holds ``folder``, or its lock file is not a
            regular file of its own (a symbolic link, a hard link: never written through).
    """

    def __init__(self, folder: Union[str, os.PathLike], *, interval: int = 1,
                 keep_last_n: Optional[int] = None, async_save: bool = False,
                 stage_in_background: bool = False):
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f"interval must be an integer >= 1, got {interval!r}")
        if keep_last_n is not None and (not isinstance(keep_last_n, int) or keep_last_n < 1):
            raise ValueError(f"keep_last_n must be None or an integer >= 1, got {keep_last_n!r}")
        self._store = store_for(folder)
        self.folder = self._store.location
        self.interval = interval
        self.keep_last_n = keep_last_n
        if stage_in_background and not async_save:
            raise ValueError("stage_in_background=True needs async_save=True")
        self.async_save = async_save
        self.stage_in_background = stage_in_background
        self._pending: Optional[AsyncSaveFuture] = None
        self._pending_step: Optional[int] = None
        refusal = None
        if get_platform().rank == 0:
            # Held until close(), the manager is collected, or the process ends.
            refusal = self._store.hold()
        self._unlock = weakref.finalize(self, self._store.release)
        if self._agree(0 if refusal is None else None) is None:
            raise CheckpointError(refusal or f"{self.folder} is in use by another job (see rank 0)")
        self._barrier()

    def _check_lock(self) -> None:
        """Every rank: refuse to save once rank 0 lost the folder's lock (a lease) to another job."""
        if not self._store.lock_can_be_lost:
            return
        problem = self._store.lock_problem() if get_platform().rank == 0 else None
        if self._agree(0 if problem is None else None) is None:
            raise CheckpointError(f"{problem or 'rank 0 lost the lock of ' + self.folder}; this job saves no more "
                                  "checkpoints there (another job took the folder over)")

    def close(self) -> None:
        """Wait for a pending save, then release the folder lock (another job may then use it)."""
        self.wait()
        self._unlock()  # runs once

    # ------------------------------------------------------------------ queries

    def checkpoint_path(self, step: int) -> str:
        """Where checkpoint ``step`` is (``folder/step-{N}``)."""
        return self._store.step(step).location

    def committed_steps(self) -> List[int]:
        """Steps of committed checkpoints in ``folder``, ascending (pending/partial dirs ignored)."""
        return self._store.committed_steps()

    def latest_step(self) -> Optional[int]:
        """The highest step with a committed checkpoint, or None."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Dict[str, Any], *, force: bool = False) -> Union[bool, AsyncSaveFuture]:
        """Checkpoint ``state`` as ``step`` if ``step % interval == 0`` or ``force``.

        Returns False when skipped; True after a synchronous save committed; for
        ``async_save`` a Future that completes when the checkpoint committed (then old
        checkpoints beyond ``keep_last_n`` are removed by ``wait()`` / the next save).

        Raises:
            ValueError: ``step`` is negative or ``state`` is not a dict.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer, got {step!r}")
        if not isinstance(state, dict):
            raise ValueError(f"state must be a dict of name -> value, got {type(state).__name__}")
        if not force and step % self.interval:
            return False
        self.wait()  # one save in flight at a time; also applies retention for the previous one
        self._check_lock()
        path = self.checkpoint_path(step)
        if self.async_save:
            self._pending = api.async_save(state, checkpoint_id=path, no_dist=self._no_dist(),
                                           stage_in_background=self.stage_in_background)
            self._pending_step = step
            return self._pending
        api.save(state, checkpoint_id=path, no_dist=self._no_dist())
        self._apply_retention(step)
        return True

    def wait_for_staging(self) -> None:
        """Block until the pending async save (if any) has staged its state; after this,
        in-place updates cannot reach it.

        Raises:
            what its staging raised.
        """
        if self._pending is not None:
            self._pending.wait_for_staging()

    def wait(self) -> None:
        """Block until the pending async save (if any) committed, then apply retention.

        Raises:
            whatever the background save raised.
        """
        pending, step = self._pending, self._pending_step
        if pending is None:
            return
        self._pending = self._pending_step = None
        pending.result()
        self._barrier()  # every rank's part is written before anyone deletes
        self._apply_retention(step)

    def _apply_retention(self, saved_step: int) -> None:
        if get_platform().rank == 0:
            problem = self._store.confirm_lock(f"delete old checkpoints and uploads in {self.folder}")
            if problem is not None:  # another job's folder now: delete nothing
                _log.error("%s", problem)
                self._barrier()
                return
            self._store.after_commit()  # no save of this job is in flight now
        if self.keep_last_n is not None and get_platform().rank == 0:
            steps = self.committed_steps()
            keep = set(steps[-self.keep_last_n:]) | {saved_step, steps[-1] if steps else saved_step}
            for old in steps:
                if old not in keep:
                    self._store.step(old).remove()
        self._barrier()

    # ------------------------------------------------------------------ load

    def load_latest(self, state: Dict[str, Any]) -> Optional[int]:
        """Load the latest committed checkpoint into ``state`` in place.

        Tensors are filled in place, Stateful objects get ``load_state_dict``, plain values
        are replaced in the ``state`` dict. Every rank loads the step rank 0 found. A
        checkpoint that fails to load and fails ``verify_checkpoint`` (corrupt) is skipped
        for the previous one, with one warning line (logger ``hyper_parallel...manager``).

        Returns:
            The loaded step, or None when there is no committed checkpoint.

        Raises:
            CheckpointError: a sound checkpoint does not fit ``state`` (see ``load``), or
                every committed checkpoint is corrupt.
        """
        self.wait()
        step = self._agree(self.latest_step())
        newest_error: Optional[CheckpointError] = None
        while step is not None:
            try:
                api.load(state, checkpoint_id=self.checkpoint_path(step), no_dist=self._no_dist())
                return step
            except CheckpointError as exc:
                corrupt, previous = self._agree_pair(self._corrupt_and_previous(step))
                if not corrupt:
                    raise  # the checkpoint is sound: it does not fit ``state``
                newest_error = newest_error or exc
                if get_platform().rank == 0:
                    _log.warning("checkpoint %s is corrupt (%s); resuming from %s instead", self.checkpoint_path(step),
                                 exc, "scratch" if previous is None else self.checkpoint_path(previous))
                step = previous
        if newest_error is not None:
            raise CheckpointError(f"no loadable checkpoint in {self.folder}; the newest failed with: "
                                  f"{newest_error}") from None
        return None

    def _corrupt_and_previous(self, step: int) -> Tuple[bool, Optional[int]]:
        """Rank 0: whether ``step`` fails ``verify_checkpoint``, and the committed step before it."""
        if get_platform().rank != 0:
            return False, None
        try:
            # Damage only: pickled values are no corruption (load refused them, not verify).
            api.verify_checkpoint(self.checkpoint_path(step), allow_pickle=True)
        except CheckpointError:
            earlier = [s for s in self.committed_steps() if s < step]
            return True, earlier[-1] if earlier else None
        return False, None

    # ------------------------------------------------------------------ process group

    @staticmethod
    def _no_dist() -> bool:
        return not dist.is_initialized()

    @staticmethod
    def _barrier() -> None:
        if dist.is_initialized():
            dist.barrier()

    @staticmethod
    def _agree(step: Optional[int]) -> Optional[int]:
        """Rank 0's ``step`` on every rank (file listings may lag on network file systems)."""
        if not dist.is_initialized():
            return step
        value = torch.tensor([-1 if step is None else step], dtype=torch.int64,
                             device=get_platform().current_device())
        dist.broadcast(value, src=0)
        return None if value.item() < 0 else int(value.item())

    @classmethod
    def _agree_pair(cls, pair: Tuple[bool, Optional[int]]) -> Tuple[bool, Optional[int]]:
        """Rank 0's ``(flag, step)`` on every rank."""
        flag, step = pair
        return bool(cls._agree(int(flag))), cls._agree(step)
