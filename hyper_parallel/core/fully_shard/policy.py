"""Mixed-precision and offload policies of ``fully_shard``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn


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
