"""The all-gather extension protocol (FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``).

A parameter whose local tensor is a subclass defining both hooks (e.g. torchao's float8
``WeightWithDynamicFloat8CastTensor``) contributes what ``fsdp_pre_all_gather`` returns (e.g.
its float8 bytes) to its group's all-gather instead of its own values, and its unsharded
parameter is what ``fsdp_post_all_gather`` builds from the gathered tensors
(docs/fully_shard.md, "All-gather extensions"). Such parameters form one
:class:`ExtensionBucket` per group and dtype: the gather runs on bytes (``uint8`` views), so
it works on backends without float8 collectives (gloo, some hccl versions).
"""

from __future__ import annotations

import inspect
from typing import Any, Optional, Protocol, Sequence, Tuple, runtime_checkable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hyper_parallel.core.fully_shard.policy import MixedPrecisionPolicy


@runtime_checkable
class AllGatherExtension(Protocol):
    """A local-tensor subclass that decides what fully_shard all-gathers for it (torch's FSDP2
    contract). ``fsdp_pre_all_gather`` takes either ``(mesh)`` or ``(mesh, outer_size,
    outer_stride, module, mp_policy)``."""

    def fsdp_pre_all_gather(self, mesh: DeviceMesh, *args: Any) -> Tuple[Tuple[torch.Tensor, ...], Any]:
        ...

    def fsdp_post_all_gather(self, all_gather_outputs: Tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: Optional[torch.Tensor] = None) -> Any:
        ...


def is_extension(local: torch.Tensor) -> bool:
    """Whether ``local`` implements :class:`AllGatherExtension`.

    Raises:
        ValueError: it defines only one of the two hooks.
    """
    if isinstance(local, AllGatherExtension):
        return True
    if hasattr(local, "fsdp_pre_all_gather") or hasattr(local, "fsdp_post_all_gather"):
        raise ValueError(f"{type(local).__name__} defines only one of fsdp_pre_all_gather / "
                         "fsdp_post_all_gather: an all-gather extension needs both")
    return False


def _data_name(tensor: torch.Tensor) -> str:
    """The inner tensor (``__tensor_flatten__``) holding a wrapper subclass's values: the one
    with its outer shape and dtype."""
    names, _ = tensor.__tensor_flatten__()
    matches = [n for n in names if getattr(tensor, n).shape == tensor.shape
               and getattr(tensor, n).dtype == tensor.dtype]
    if len(matches) != 1:
        raise ValueError(f"fully_shard cannot find the values of {type(tensor).__name__}: it needs "
                         "exactly one inner tensor (__tensor_flatten__) of the outer shape and dtype")
    return matches[0]


def extension_data(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding an extension subclass's values."""
    return getattr(tensor, _data_name(tensor))


def wrap_like(template: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
    """``template``'s subclass (same configuration) around the plain tensor ``data``, so the
    sharded parameter keeps its extension while its values live in the group's flat buffer."""
    names, ctx = template.__tensor_flatten__()
    data_name = _data_name(template)
    inner = {n: data if n == data_name else getattr(template, n) for n in names}
    return type(template).__tensor_unflatten__(inner, ctx, data.shape, data.stride())


def call_pre_all_gather(local: torch.Tensor, mesh: DeviceMesh, shape: Tuple[int, ...], module: nn.Module,
                        mp: MixedPrecisionPolicy) -> Tuple[Sequence[torch.Tensor], Any]:
    hook = local.fsdp_pre_all_gather
    arity = len(inspect.signature(hook).parameters)
    if arity == 1:  # FSDP2's first signature, still torchao's
        return hook(mesh)
    if arity == 5:
        return hook(mesh, torch.Size(shape), tuple(torch.empty(shape, device="meta").stride()), module, mp)
    raise TypeError(f"{type(local).__name__}.fsdp_pre_all_gather{inspect.signature(hook)} must take "
                    "(mesh) or (mesh, outer_size, outer_stride, module, mp_policy)")
