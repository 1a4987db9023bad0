"""What a training checkpoint holds, and the cooperative stop on SIGTERM."""

from __future__ import annotations

import signal
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel.data import DistributedBatchLoader
from hyper_parallel.trainer.schedule import WarmupCosineSchedule


class RNGState:
    """The CPU (and accelerator) generator state, the same on every rank by construction.

    The recipe seeds all ranks identically; anything random during training must be drawn
    identically on every rank (or derived from the step), so one state restores any mesh.
    """

    def __init__(self, device_module=None):
        self.device_module = device_module

    def state_dict(self) -> Dict[str, Any]:
        state = {"torch": torch.get_rng_state()}
        if self.device_module is not None:
            state["device"] = self.device_module.get_rng_state()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        torch.set_rng_state(state["torch"])
        if self.device_module is not None and "device" in state:
            self.device_module.set_rng_state(state["device"])


def training_state(model: nn.Module, optimizer: torch.optim.Optimizer, schedule: WarmupCosineSchedule,
                   loader: DistributedBatchLoader, rng: RNGState) -> Dict[str, Any]:
    """The Stateful objects a checkpoint saves and a resumed job restores (on any mesh)."""
    from hyper_parallel.checkpoint import ModelState, OptimizerState

    return {
        "model": ModelState(model),
        "optim": OptimizerState(model, optimizer),
        "lr_schedule": schedule,
        "data": loader,
        "rng": rng,
    }


class StopRequest:
    """Remembers a SIGTERM so that all ranks can agree to stop at the same step boundary.

    The flag travels in the same all-reduce as the step's loss (see :meth:`as_tensor_value`):
    if any rank got the signal, every rank sees it after that step.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def install(self) -> "StopRequest":
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        self.requested = True

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    @property
    def as_tensor_value(self) -> float:
        return 1.0 if self.requested else 0.0


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum over all ranks (a no-op without a process group)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values)
    return values
