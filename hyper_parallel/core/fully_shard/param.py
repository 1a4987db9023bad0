"""HSDPParam: one parameter managed by fully_shard (sharded DTensor, padded shard, unsharded view)."""

from __future__ import annotations

import math
import weakref
from typing import List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hyper_parallel._torch_compat import DTensorSpec, TensorMeta
from hyper_parallel.core.fully_shard.mesh import DataParallelMesh, sharded_layout


def _contiguous_stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


class HSDPParam:
    """One managed parameter.

    Internally the shard dim ``d`` is moved to the front: the padded local shard is a contiguous
    ``(chunk, *rest)`` block of its group's flat shard buffer (``chunk = ceil(size_d / W)``), and
    the DTensor's local tensor is the unpadded ``narrow(0, 0, valid).movedim(0, d)`` view of it.
    The unsharded parameter is the same kind of view into the group's all-gathered buffer, so
    uneven sizes on any dim need no extra copies beyond the all-gather copy-out.

    Attributes:
        sharded_param: the ``nn.Parameter`` (DTensor) the optimizer and ``state_dict`` see.
        unsharded_param: the ``nn.Parameter`` used by forward/backward while unsharded.
        slots: ``(module, name)`` pairs that hold this parameter (several when tied).
    """

    def __init__(self, param: nn.Parameter, slots: List[Tuple[nn.Module, str]],
                 dp: DataParallelMesh, shard_dim: int):
        self.slots = slots
        self.original = weakref.ref(param)  # the parameter before sharding (tied elsewhere?)
        self.requires_grad = param.requires_grad
        if isinstance(param, DTensor):
            self.tp_mesh, self.tp_placements = param.device_mesh, tuple(param.placements)
            local = param._local_tensor
        else:
            self.tp_mesh, self.tp_placements = None, ()
            local = param.detach()
        if local.ndim == 0:
            raise ValueError("fully_shard cannot shard a 0-dim parameter; pass it in ignored_params")
        if not -local.ndim <= shard_dim < local.ndim:
            raise ValueError(f"shard dim {shard_dim} is out of range for a parameter of shape "
                             f"{tuple(local.shape)}")
        self.global_shape = tuple(param.shape)
        self.shard_dim = shard_dim % local.ndim
        self.dtype = local.dtype
        self.unsharded_local_shape = tuple(local.shape)
        size = local.shape[self.shard_dim]
        self.world = dp.shard_size
        self.chunk = math.ceil(size / self.world)
        self.rest_shape = tuple(s for i, s in enumerate(local.shape) if i != self.shard_dim)
        self.shard_numel = self.chunk * math.prod(self.rest_shape)
        self.shard_offset = min(dp.shard_rank * self.chunk, size)
        self.valid = min(self.chunk, size - self.shard_offset)
        mesh, placements = sharded_layout(dp, self.shard_dim, self.tp_mesh, self.tp_placements)
        self.spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(
            torch.Size(self.global_shape), _contiguous_stride(self.global_shape), self.dtype))
        self._initial_local: Optional[torch.Tensor] = local  # copied into the shard on bind
        self.sharded_param: Optional[nn.Parameter] = None
        self.unsharded_param: Optional[nn.Parameter] = None

    def _local_view(self, padded_flat: torch.Tensor) -> torch.Tensor:
        """Unpadded local shard (original dim order) viewing a flat padded shard."""
        padded = padded_flat.view(self.chunk, *self.rest_shape)
        return padded.narrow(0, 0, self.valid).movedim(0, self.shard_dim)

    def bind_shard(self, padded_flat: torch.Tensor) -> None:
        """Make the sharded DTensor's local tensor a view of ``padded_flat`` (its slot in the
        group's flat shard buffer), keeping the current values (e.g. after ``to_empty`` +
        init). Keeps the ``nn.Parameter`` object, so optimizers built earlier stay valid."""
        local = self._local_view(padded_flat)
        if self.sharded_param is None:
            source = self._initial_local
            self._initial_local = None
            if not source.is_meta:
                local.copy_(source.narrow(self.shard_dim, self.shard_offset, self.valid))
            self.sharded_param = nn.Parameter(DTensor(local, self.spec, requires_grad=False),
                                              requires_grad=self.requires_grad)
        else:
            current = self.sharded_param._local_tensor
            if not current.is_meta and current.data_ptr() != local.data_ptr():
                local.copy_(current)
        self.sharded_param._local_tensor = local

    def bind_unsharded(self, padded_full_flat: torch.Tensor) -> None:
        """Create the unsharded parameter as a view of its slot in the group's unsharded buffer."""
        full = padded_full_flat.view(self.world * self.chunk, *self.rest_shape)
        full = full.narrow(0, 0, self.unsharded_local_shape[self.shard_dim]).movedim(0, self.shard_dim)
        if self.tp_mesh is not None:
            full = DTensor.from_local(full, self.tp_mesh, self.tp_placements, run_check=False,
                                      shape=torch.Size(self.global_shape),
                                      stride=_contiguous_stride(self.global_shape))
        self.unsharded_param = nn.Parameter(full, requires_grad=self.requires_grad)

    def unsharded_grad(self) -> Optional[torch.Tensor]:
        """The unsharded gradient (shard dim first, local over TP), or None."""
        grad = self.unsharded_param.grad
        if grad is None:
            return None
        if isinstance(grad, DTensor):
            if tuple(grad.placements) != self.tp_placements:
                grad = grad.redistribute(placements=self.tp_placements)
            grad = grad._local_tensor
        return grad.movedim(self.shard_dim, 0)

    def accumulate_sharded_grad(self, padded_flat: torch.Tensor) -> None:
        """Set (or add to) the sharded gradient from its slot of a reduced flat buffer."""
        local = self._local_view(padded_flat)
        grad = self.sharded_param.grad
        if grad is None:
            self.sharded_param.grad = DTensor(local, self.spec, requires_grad=False)
        else:
            grad._local_tensor.add_(local)

    def use_sharded(self) -> None:
        for module, name in self.slots:
            module._parameters[name] = self.sharded_param

    def shard_full(self, full: torch.Tensor) -> DTensor:
        """This rank's shard of a full (global) tensor as a DTensor like ``sharded_param``.

        Raises:
            ValueError: ``full`` does not have the parameter's global shape.
        """
        if tuple(full.shape) != self.global_shape:
            raise ValueError(f"full tensor of shape {tuple(full.shape)} does not match the "
                             f"parameter's shape {self.global_shape}")
        local = full
        if self.tp_mesh is not None:
            local = distribute_tensor(full, self.tp_mesh, self.tp_placements, src_data_rank=None).to_local()
        local = local.narrow(self.shard_dim, self.shard_offset, self.valid)
        local = local.to(device=self.sharded_param._local_tensor.device, dtype=self.dtype)
        return DTensor(local, self.spec, requires_grad=False)
