"""CheckpointManager: periodic saves to ``folder/step-{N}``, retention, resume from the latest."""

from __future__ import annotations

import os
import re
import shutil
from concurrent.futures import Future
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from hyper_parallel.core.distributed_checkpoint import api
from hyper_parallel.core.distributed_checkpoint.commit import is_checkpoint, staging_target
from hyper_parallel.platform import get_platform

__all__ = ["CheckpointManager", "checkpoint_step"]

_STEP_DIR = re.compile(r"step-(\d+)")


def checkpoint_step(path: Union[str, os.PathLike]) -> Optional[int]:
    """The step encoded in a ``step-{N}`` directory name, or None."""
    match = _STEP_DIR.fullmatch(os.path.basename(os.path.normpath(os.fspath(path))))
    return int(match.group(1)) if match else None


class CheckpointManager:
    """Saves every ``interval`` steps into ``folder/step-{N}`` and keeps the newest ``keep_last_n``.

    ``state`` (for ``save`` and ``load_latest``) maps names to tensors, plain values or
    Stateful objects (``state_dict()`` / ``load_state_dict()``, e.g. :class:`ModelState`,
    :class:`OptimizerState`). All ranks call every method; without a process group the
    manager works single-process. Rank 0 deletes old checkpoints (shared file system).

    Args:
        folder: directory holding the ``step-{N}`` checkpoints (created if missing).
        interval: ``save(step, ...)`` writes when ``step % interval == 0``.
        keep_last_n: committed checkpoints to keep (None: keep all). Deletion happens only
            after a new checkpoint committed; the newest one is never deleted.
        async_save: ``save`` returns a Future right after staging; the write runs in the
            background and ``wait()`` blocks until it committed.

    Raises:
        ValueError: ``interval < 1`` or ``keep_last_n < 1``.
    """

    def __init__(self, folder: Union[str, os.PathLike], *, interval: int = 1,
                 keep_last_n: Optional[int] = None, async_save: bool = False):
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f"interval must be an integer >= 1, got {interval!r}")
        if keep_last_n is not None and (not isinstance(keep_last_n, int) or keep_last_n < 1):
            raise ValueError(f"keep_last_n must be None or an integer >= 1, got {keep_last_n!r}")
        self.folder = os.fspath(folder)
        self.interval = interval
        self.keep_last_n = keep_last_n
        self.async_save = async_save
        self._pending: Optional[Future] = None
        self._pending_step: Optional[int] = None
        if get_platform().rank == 0:
            os.makedirs(self.folder, exist_ok=True)
            # Nothing of ours is being written yet: staging dirs of step-N now are from crashed runs.
            for name in os.listdir(self.folder):
                target = staging_target(name)
                if target is not None and checkpoint_step(target) is not None:
                    shutil.rmtree(os.path.join(self.folder, name), ignore_errors=True)
        self._barrier()

    # ------------------------------------------------------------------ queries

    def checkpoint_path(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def committed_steps(self) -> List[int]:
        """Steps of committed checkpoints in ``folder``, ascending (staging/partial dirs ignored)."""
        if not os.path.isdir(self.folder):
            return []
        steps = (checkpoint_step(name) for name in os.listdir(self.folder))
        return sorted(s for s in steps if s is not None and is_checkpoint(self.checkpoint_path(s)))

    def latest_step(self) -> Optional[int]:
        """The highest step with a committed checkpoint, or None."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Dict[str, Any], *, force: bool = False) -> Union[bool, Future]:
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
        path = self.checkpoint_path(step)
        if self.async_save:
            self._pending = api.async_save(state, checkpoint_id=path, no_dist=self._no_dist())
            self._pending_step = step
            return self._pending
        api.save(state, checkpoint_id=path, no_dist=self._no_dist())
        self._apply_retention(step)
        return True

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
        if self.keep_last_n is not None and get_platform().rank == 0:
            steps = self.committed_steps()
            keep = set(steps[-self.keep_last_n:]) | {saved_step, steps[-1] if steps else saved_step}
            for old in steps:
                if old not in keep:
                    shutil.rmtree(self.checkpoint_path(old), ignore_errors=True)
        self._barrier()

    # ------------------------------------------------------------------ load

    def load_latest(self, state: Dict[str, Any]) -> Optional[int]:
        """Load the latest committed checkpoint into ``state`` in place.

        Tensors are filled in place, Stateful objects get ``load_state_dict``, plain values
        are replaced in the ``state`` dict. Every rank loads the step rank 0 found.

        Returns:
            The loaded step, or None when there is no committed checkpoint.

        Raises:
            CheckpointError: the checkpoint does not fit ``state`` (see ``load``).
        """
        self.wait()
        step = self._agree(self.latest_step())
        if step is None:
            return None
        api.load(state, checkpoint_id=self.checkpoint_path(step), no_dist=self._no_dist())
        return step

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
