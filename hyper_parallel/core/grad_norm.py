"""Gradient-norm clipping for gradients that are DTensors on any mix of meshes, or plain tensors.

Each rank adds up (p-norm) or takes the max (inf-norm) over the local slices it *owns*: a
DTensor's local slice is owned by the rank whose coordinate is 0 on every mesh dim the tensor
is replicated on, so every distinct slice is counted exactly once and replicas are skipped.
Owned contributions are then reduced once per reduction scope: all meshes spanning the whole
world share one all-reduce over the default group; a mesh covering only part of the world
(e.g. one pipeline stage) is reduced over its own dims. Plain tensors are taken as replicated
and contribute locally without communication. With pipeline parallelism each rank holds only
its stages' parameters: ``pp_group`` (the pipeline group, one rank per stage position) adds
up the stages' totals.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from hyper_parallel._torch_compat import foreach_mul_
from hyper_parallel.platform import get_platform
from hyper_parallel.utils.ranks import rank_and_world

__all__ = ["clip_grad_norm_", "get_total_norm"]

_Tensors = Union[torch.Tensor, Iterable[torch.Tensor]]
# Reduction scope: ("world", device_type) for world-spanning meshes, a DeviceMesh otherwise,
# None for plain tensors (no communication).
_Scope = Union[None, Tuple[str, str], DeviceMesh]


@torch.no_grad()
def clip_grad_norm_(
    parameters: _Tensors,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    pp_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` in place to a total norm of at most ``max_norm``.

    The total norm is that of all gradients concatenated into one vector, the same number
    single-process training on the full gradients gives, whatever the gradients' layouts:
    DTensors sharded or replicated on any dims of any meshes (several meshes in one call
    included) and plain tensors. Gradients are multiplied by
    ``min(max_norm / (total_norm + 1e-6), 1)``.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is clipped.
        max_norm: the largest allowed total norm.
        norm_type: p of the p-norm (> 0), or ``float("inf")`` for the max-abs norm.
        error_if_nonfinite: raise if the total norm is nan or inf.
        foreach: use torch's foreach kernels (None: where supported), as in torch.
        pp_group: with pipeline parallelism, the process group of the ranks holding the other
            stages (each rank passes only its own stages' parameters); the total norm is
            then over every stage's gradients. Every rank of the group must call this.

    Returns:
        The total norm as a plain tensor, equal on every rank: float64 when any gradient is
        float64, float32 otherwise.

    Raises:
        ValueError: ``norm_type`` is not positive, or a gradient lives on a mesh that does
            not include this rank.
        RuntimeError: the total norm is non-finite and ``error_if_nonfinite`` is set.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = get_total_norm(
        grads, norm_type, error_if_nonfinite=error_if_nonfinite, foreach=foreach, pp_group=pp_group
    )
    coef = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
    _scale_(grads, coef, foreach)
    return total_norm


@torch.no_grad()
def get_total_norm(
    tensors: _Tensors,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    pp_group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """The norm of ``tensors`` viewed as one vector, over their global (unsharded) values.

    Same arguments and errors as :func:`clip_grad_norm_`, but for the tensors themselves
    (e.g. gradients) and without modifying them.
    """
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    p = float(norm_type)
    if not p > 0:
        raise ValueError(f"norm_type must be > 0 or inf, got {norm_type!r}")
    if not tensors and pp_group is None:
        return torch.tensor(0.0)
    out_device = _local(tensors[0]).device if tensors else _collective_device(get_platform().device_type)
    # Accumulate in float32 at least; every rank sees the same dtypes, so collectives match.
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    total = _local_contribution([], p, foreach, dtype).to(out_device)
    for scope, local_tensors in _owned_local_tensors(tensors).items():
        contribution = _local_contribution(local_tensors, p, foreach, dtype)
        total = _combine(total, _reduce(scope, contribution, p).to(out_device), p)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        total = _reduce_over_stages(total, dtype, p, pp_group).to(out_device)
    if math.isinf(p):
        # [max, any-nan] -> max, or nan if any slice anywhere held a nan.
        norm = torch.where(total[1] > 0, torch.full_like(total[0], math.nan), total[0])
    else:
        norm = total[0] ** (1.0 / p)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(
            f"the total norm of order {p} of the gradients is non-finite ({norm.item()}), so "
            "they cannot be clipped; pass error_if_nonfinite=False to scale them anyway"
        )
    return norm


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _owned_local_tensors(tensors: Iterable[torch.Tensor]) -> Dict[_Scope, List[torch.Tensor]]:
    """Per reduction scope (in first-seen order, equal on all ranks), the local slices this rank owns.

    Every scope a tensor maps to is listed even when this rank owns none of its slices:
    the rank must still join that scope's collective.
    """
    _, world = rank_and_world()
    owned: Dict[_Scope, List[torch.Tensor]] = {}
    for tensor in tensors:
        if not isinstance(tensor, DTensor):
            owned.setdefault(None, []).append(tensor)
            continue
        if any(pl.is_partial() for pl in tensor.placements):
            # A partial slice is a summand, not a slice: its norm says nothing about the sum's.
            tensor = tensor.redistribute(
                tensor.device_mesh,
                [Replicate() if pl.is_partial() else pl for pl in tensor.placements],
            )
        mesh = tensor.device_mesh
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError(
                f"a gradient lives on mesh {mesh} that does not include rank {dist.get_rank()}"
            )
        scope: _Scope = ("world", mesh.device_type) if mesh.size() == world else mesh
        slices = owned.setdefault(scope, [])
        # Only replicated dims hold copies; every other placement (Shard, _StridedShard, ...)
        # splits the tensor, so each of its coordinates holds a distinct slice.
        if all(c == 0 for c, pl in zip(coordinate, tensor.placements) if pl.is_replicate()):
            slices.append(tensor.to_local())
    return owned


def _local_contribution(tensors: List[torch.Tensor], p: float, foreach: bool | None,
                        dtype: torch.dtype) -> torch.Tensor:
    """``[sum |x|^p]`` for finite p, ``[max |x|, any nan]`` for inf, over ``tensors`` (in ``dtype``)."""
    # Empty slices (uneven sharding) add nothing, and torch has no inf-norm of an empty tensor.
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros(2 if math.isinf(p) else 1, dtype=dtype)
    norm = torch.nn.utils.get_total_norm(tensors, p, foreach=foreach).to(dtype)
    if math.isinf(p):
        return torch.stack((norm, norm.isnan().to(dtype)))
    return (norm**p).reshape(1)


def _reduce(scope: _Scope, contribution: torch.Tensor, p: float) -> torch.Tensor:
    if scope is None:
        return contribution
    op = dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM
    if isinstance(scope, tuple):
        buffer = contribution.to(_collective_device(scope[1]))
        if dist.get_world_size() > 1:
            dist.all_reduce(buffer, op=op)
        return buffer
    buffer = contribution.to(_collective_device(scope.device_type))
    # Sum (or max) over each dim in turn is the sum over the whole mesh.
    for dim in range(scope.ndim):
        if scope.size(dim) > 1:
            dist.all_reduce(buffer, op=op, group=scope.get_group(dim))
    return buffer


def _reduce_over_stages(total: torch.Tensor, dtype: torch.dtype, p: float,
                        pp_group: dist.ProcessGroup) -> torch.Tensor:
    """Sum (max) the stages' totals over ``pp_group``. Stages may hold gradients of different
    dtypes (one without gradients has none): reduce in float64 with a flag, and give every
    stage float64 when any stage has a float64 gradient, as one process would."""
    device = _collective_device(get_platform().device_type)
    flag = torch.tensor([float(dtype == torch.float64)], dtype=torch.float64)
    combined = torch.cat((total.to(torch.float64).cpu(), flag)).to(device)
    dist.all_reduce(combined, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM, group=pp_group)
    return combined[:-1].to(torch.float64 if combined[-1] > 0 else torch.float32)


def _combine(a: torch.Tensor, b: torch.Tensor, p: float) -> torch.Tensor:
    return torch.maximum(a, b) if math.isinf(p) else a + b


def _collective_device(device_type: str) -> torch.device:
    platform = get_platform()
    if device_type == platform.device_type:
        return platform.current_device()
    return torch.device(device_type)


def _scale_(grads: List[torch.Tensor], coef: torch.Tensor, foreach: bool | None) -> None:
    """Multiply every gradient (its local slice, for DTensors) by the scalar tensor ``coef``."""
    by_device_dtype: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for grad in grads:
        local = _local(grad)
        by_device_dtype.setdefault((local.device, local.dtype), []).append(local)
    for (device, _), group in by_device_dtype.items():
        device_coef = coef.to(device)
        if foreach is False:
            for tensor in group:
                tensor.mul_(device_coef)
        else:
            foreach_mul_(group, device_coef)
