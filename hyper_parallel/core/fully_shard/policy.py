"""Mixed-precision and offload policies of ``fully_shard``, and the conversion of torch's
(``torch.distributed.fsdp``) policy objects to them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn
# torch's classes, bound here: patch_torch_fsdp() replaces the names in torch.distributed.fsdp
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import OffloadPolicy as TorchOffloadPolicy


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes used around a parameter group's compute.

    Args:
        param_dtype: dtype of the unsharded parameters used in forward/backward (all-gathered in
            this dtype); None keeps each parameter's own dtype. Sharded parameters (the
            optimizer's master weights) always keep their dtype.
        reduce_dtype: dtype in which gradients are reduce-scattered / all-reduced; None means
            the compute dtype.
        output_dtype: floating outputs of the wrapped module's forward are cast to it.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
        param_dtype_override_fn: ``param -> dtype | None`` (torch 2.15's name): a compute dtype
            for this parameter instead of ``param_dtype`` (None: ``param_dtype``), e.g. to keep
            a few parameters in float32 under bf16. Called once per parameter at
            ``fully_shard`` time with the parameter as it was before sharding; must give the
            same answer on every rank. Parameters are all-gathered per (dtype, compute dtype)
            bucket, so each distinct override adds one all-gather to the group.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    param_dtype_override_fn: Optional[Callable[[nn.Parameter], Optional[torch.dtype]]] = None


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: sharded parameters and gradients live on the compute device."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters and gradients live on CPU; the optimizer steps there.

    Args:
        pin_memory: pin the CPU shards (faster host-device copies). Honoured only where the
            platform has pinned memory (accelerators); ignored on a CPU-only run.
    """

    pin_memory: bool = True


def _convert(policy: object, ours: type) -> object:
    """torch's policy dataclass ``policy`` as an instance of ``ours`` (field by field).

    Raises:
        TypeError: ``policy`` has a field ``ours`` does not know (a newer torch feature).
    """
    values = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    known = {f.name for f in dataclasses.fields(ours)}
    unknown = sorted(name for name in values if name not in known)
    if unknown:
        raise TypeError(f"torch's {type(policy).__name__} field(s) {unknown} are not supported by "
                        f"hyper_parallel.fully_shard")
    return ours(**values)


def as_mp_policy(policy: object) -> MixedPrecisionPolicy:
    """``policy`` as our :class:`MixedPrecisionPolicy`: ours as is, torch's
    ``torch.distributed.fsdp.MixedPrecisionPolicy`` converted field by field (same names).

    Raises:
        TypeError: anything else, or a torch field we do not have.
    """
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    if isinstance(policy, TorchMixedPrecisionPolicy):
        return _convert(policy, MixedPrecisionPolicy)
    raise TypeError(f"mp_policy must be a MixedPrecisionPolicy (hyper_parallel's or torch's), "
                    f"got {type(policy).__name__}")


def as_offload_policy(policy: object) -> OffloadPolicy:
    """``policy`` as our :class:`OffloadPolicy`: ours as is, torch's ``OffloadPolicy`` /
    ``CPUOffloadPolicy`` (``torch.distributed.fsdp``) converted (``pin_memory`` kept).

    Raises:
        TypeError: anything else, e.g. another subclass of torch's ``OffloadPolicy``.
    """
    if isinstance(policy, OffloadPolicy):
        return policy
    if type(policy) in (TorchCPUOffloadPolicy, TorchOffloadPolicy):
        ours = CPUOffloadPolicy if type(policy) is TorchCPUOffloadPolicy else OffloadPolicy
        return _convert(policy, ours)
    raise TypeError(f"offload_policy must be OffloadPolicy() or CPUOffloadPolicy(...) (hyper_parallel's or "
                    f"torch's), got {type(policy).__name__}")
