"""What a training checkpoint holds: the job's Stateful objects, saved and restored on any mesh."""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from hyper_parallel.checkpoint import ModelState, OptimizerState
from hyper_parallel.data import DistributedBatchLoader
from hyper_parallel.trainer.config.parallel import ParallelDims
from hyper_parallel.trainer.step.schedule import WarmupCosineSchedule

# Entries a checkpoint records but a resumed job does not load (the run's own layout wins).
SAVED_ONLY = ("parallel",)


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


class ParallelLayout:
    """The degrees of the mesh a checkpoint was saved on, as small JSON values (``checkpoint
    inspect`` shows them in one line); never loaded: a checkpoint resumes on any mesh."""

    def __init__(self, dims: ParallelDims):
        self.dims = dims

    def state_dict(self) -> Dict[str, Any]:
        d = self.dims
        layout = {"pp": d.pp, "dp_replicate": d.replicate, "dp_shard": d.shard, "tp": d.tp}
        return {**layout, "cp": d.cp} if d.cp > 1 else layout

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        pass  # informational: this run's layout is its config's


def training_state(model: Union[nn.Module, Sequence[nn.Module]], optimizer: torch.optim.Optimizer,
                   schedule: WarmupCosineSchedule, loader: DistributedBatchLoader, rng: RNGState,
                   dims: ParallelDims, pp_group: Optional[dist.ProcessGroup] = None) -> Dict[str, Any]:
    """The Stateful objects a checkpoint saves and a resumed job restores (on any mesh; the
    :data:`SAVED_ONLY` entries are saved, not restored). ``model``: the model, or this rank's
    pipeline stage modules (the whole model's parameter names, so any split loads any other)
    and ``pp_group`` the pipeline group (the optimizer's param groups are gathered over it)."""
    return {
        "model": ModelState(model),
        "optim": OptimizerState(model, optimizer, pp_group=pp_group),
        "lr_schedule": schedule,
        "data": loader,
        "rng": rng,
        "parallel": ParallelLayout(dims),
    }
