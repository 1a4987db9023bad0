"""The loop's checkpoint saves: a full disk is one line (the folder, the space needed and free,
the checkpoints still intact) on the rank that met it, and every rank stops together."""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from hyper_parallel.checkpoint import CheckpointError, CheckpointManager, ModelState, OptimizerState
from hyper_parallel.trainer.step.agreement import fail_together
from hyper_parallel.trainer.config.compose import ConfigError
from hyper_parallel.utils.units import format_bytes

_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def state_bytes(value: Any) -> int:
    """The bytes a checkpoint of ``value`` holds: global tensor sizes (a DTensor counts whole)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, ModelState):
        return sum(state_bytes(t) for part in value.parts for t in (*part.parameters(), *part.buffers()))
    if isinstance(value, OptimizerState):
        return sum(state_bytes(t) for per_param in value.optim.state.values() for t in per_param.values())
    if isinstance(value, dict):
        return sum(map(state_bytes, value.values()))
    return 0


class CheckpointSaver:
    """``manager.save`` / ``manager.wait`` (every rank calls them at the same point); a full
    disk on any rank raises :class:`~hyper_parallel.trainer.step.agreement.JobFailed` on all.

    Args:
        manager: the job's ``CheckpointManager``.
        device: where the agreement's all-reduce runs.
    """

    def __init__(self, manager: CheckpointManager, device: torch.device):
        self.manager, self.device = manager, device
        self._writing: Optional[Tuple[int, Dict[str, Any]]] = None  # an async save still being written

    def save(self, step: int, state: Dict[str, Any], *, force: bool) -> None:
        # A due save first waits for the previous async one, whose write failure surfaces here.
        with self._agreed(*(self._writing or (step, state))):
            started = self.manager.save(step, state, force=force)
        if started:
            self._writing = (step, state) if self.manager.async_save else None

    def wait(self) -> None:
        """Until the pending async save (if any) committed."""
        if self._writing is not None:
            with self._agreed(*self._writing):
                self.manager.wait()
            self._writing = None

    @contextmanager
    def _agreed(self, step: int, state: Dict[str, Any]) -> Iterator[None]:
        """Run the body on every rank; a full disk on any rank fails all (one all-reduce)."""
        error, failure = None, None
        try:
            yield
        except (OSError, CheckpointError) as err:  # CheckpointError: the save failed on another rank
            failure = err
            if isinstance(err, OSError) and err.errno in _DISK_FULL:
                error = ConfigError(self.disk_full_message(step, state, err))
        fail_together(error, self.device)
        if failure is not None:
            raise failure

    def disk_full_message(self, step: int, state: Dict[str, Any], err: OSError) -> str:
        folder = self.manager.folder
        free = shutil.disk_usage(folder).free if os.path.isdir(folder) else 0
        steps = self.manager.committed_steps()
        kept = (f"the previous checkpoints ({', '.join(f'step-{s}' for s in steps)}) are intact" if steps
                else "no earlier checkpoint exists")
        return (f"{os.strerror(err.errno).lower()} while saving the checkpoint of step {step} to {folder}: it "
                f"needs about {format_bytes(state_bytes(state))} ({state_bytes(state):,} bytes), "
                f"{format_bytes(free)} ({free:,} bytes) are free; {kept} and nothing of step {step} was kept. "
                "Free some space (or set checkpoint.folder to a larger disk, or lower checkpoint.keep_last_n) "
                "and run the same command again to resume")
