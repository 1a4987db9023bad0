"""Mixed-precision and offload policies of ``fully_shard``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


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
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True


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
