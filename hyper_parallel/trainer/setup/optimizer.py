"""The recipe's optimizer: AdamW with multi-tensor kernels, its parameters grouped by device mesh."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Union

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hyper_parallel.trainer.config.schema import OptimConfig

# Devices with a fused AdamW kernel in torch; others (e.g. NPU) take the foreach implementation.
_FUSED_DEVICE_TYPES = frozenset({"cuda", "cpu"})


Model = Union[nn.Module, Sequence[nn.Module]]  # a model, or the stage modules of a pipeline rank


def _parameters(model: Model) -> List[nn.Parameter]:
    parts = [model] if isinstance(model, nn.Module) else model
    return [p for part in parts for p in part.parameters()]


def mesh_groups(model: Model) -> List[List[nn.Parameter]]:
    """``model``'s parameters grouped by DTensor device mesh (plain tensors in a group of their
    own), in first-appearance order: one multi-tensor optimizer kernel takes the tensors of one
    mesh (DTensor refuses operations across meshes)."""
    groups: Dict[Optional[DeviceMesh], List[nn.Parameter]] = {}
    for param in _parameters(model):
        groups.setdefault(param.device_mesh if isinstance(param, DTensor) else None, []).append(param)
    return list(groups.values())


def build_optimizer(model: Model, optim_cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW as torchtitan runs it: the fused implementation where every parameter's device
    has one (CUDA, CPU), else foreach; a few kernels per parameter group and step instead of
    one per parameter and op. One parameter group per device mesh (:func:`mesh_groups`).
    ``model``: a module, or a pipeline rank's stage modules (one optimizer over all of them)."""
    fused = all(p.device.type in _FUSED_DEVICE_TYPES for p in _parameters(model))
    implementation = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW([{"params": params} for params in mesh_groups(model)], lr=optim_cfg.lr,
                             betas=tuple(optim_cfg.betas), eps=optim_cfg.eps,
                             weight_decay=optim_cfg.weight_decay, **implementation)
