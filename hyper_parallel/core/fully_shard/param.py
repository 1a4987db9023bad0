"""HSDPParam: one parameter managed by fully_shard (sharded DTensor, padded shard, unsharded view)."""

from __future__ import annotations

import math
import weakref
from typing import List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hyper_parallel._torch_compat import (DTensorSpec, TensorMeta, dtensor_spec, local_tensor, module_parameters,
                                          post_accumulate_grad_hooks,
                                          set_local_tensor)
from hyper_parallel.core.fully_shard.extension_protocol import extension_data, is_extension, wrap_like
from hyper_parallel.core.fully_shard.mesh import DataParallelMesh, sharded_layout


def _contiguous_stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def _sharded_spec(mesh, placements, shape: Tuple[int, ...], dtype: torch.dtype) -> DTensorSpec:
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(
        torch.Size(shape), _contiguous_stride(shape), dtype))


class HSDPParam:
    """One managed parameter.

    Each rank's slot in its group's flat shard buffer holds ``shard_numel`` elements
    (``chunk = ceil(size_d / W)`` slices of the shard dim ``d``): first its local shard,
    contiguous in the parameter's own dim order (``valid <= chunk`` slices), then zero padding.
    The DTensor's local tensor is a contiguous view of that slot, whatever ``d``. The unsharded
    parameter is a contiguous view of its segment of the group's unsharded buffer: for ``d = 0``
    the rank-major all-gather rows are already that layout; for ``d > 0`` the rows are
    concatenated along ``d`` (:meth:`cat_rows`), and gradients are split back into rank rows
    (:meth:`rank_rows`) for the reduce-scatter.

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
            local = local_tensor(param)
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
        # The local tensor is an all-gather extension subclass (torchao float8 weights):
        # gathered through its hooks by an ExtensionBucket; the shard keeps the subclass.
        self.extension = is_extension(local)
        self.unsharded_local_shape = tuple(local.shape)
        size = local.shape[self.shard_dim]
        self.world = dp.shard_size
        self.chunk = math.ceil(size / self.world)
        self.rest_numel = math.prod(s for i, s in enumerate(local.shape) if i != self.shard_dim)
        self.shard_numel = self.chunk * self.rest_numel
        self.shard_offset = min(dp.shard_rank * self.chunk, size)
        self.valid = min(self.chunk, size - self.shard_offset)
        self.local_shape = self._rows_shape(self.valid)
        mesh, placements = sharded_layout(dp, self.shard_dim, self.tp_mesh, self.tp_placements)
        self.spec = _sharded_spec(mesh, placements, self.global_shape, self.dtype)
        self._initial_local: Optional[torch.Tensor] = local  # copied into the shard on bind
        self._bound_local: Optional[torch.Tensor] = None  # the local view bind_shard set
        self.sharded_param: Optional[nn.Parameter] = None
        self.unsharded_param: Optional[nn.Parameter] = None
        # Plain tensor of the unsharded values (local over TP), viewing the unsharded buffer.
        self.unsharded_data: Optional[torch.Tensor] = None
        # Unreduced gradient summed in the reduce dtype over backwards without gradient sync,
        # when that dtype is wider than the compute dtype (FSDP2 accumulates there, not in bf16).
        self.accumulated_grad: Optional[torch.Tensor] = None

    def _rows_shape(self, rows: int) -> Tuple[int, ...]:
        shape = list(self.unsharded_local_shape)
        shape[self.shard_dim] = rows
        return tuple(shape)

    def _local_view(self, padded_flat: torch.Tensor) -> torch.Tensor:
        """Unpadded local shard (contiguous, original dim order) viewing a flat padded slot."""
        return padded_flat[:self.valid * self.rest_numel].view(self.local_shape)

    def rank_valid(self) -> List[int]:
        """Each rank's number of valid (unpadded) slices on the shard dim."""
        size = self.unsharded_local_shape[self.shard_dim]
        return [max(0, min(self.chunk, size - r * self.chunk)) for r in range(self.world)]

    def rank_rows(self, full: torch.Tensor) -> torch.Tensor:
        """``full`` (unsharded local shape, ``d > 0``) as ``(world, shard_numel)`` slots: row
        ``r`` holds rank ``r``'s shard flattened, then zeros."""
        rows = full.new_zeros(self.world, self.shard_numel)
        start = 0
        for r, valid in enumerate(self.rank_valid()):
            rows[r, :valid * self.rest_numel].view(self._rows_shape(valid)).copy_(
                full.narrow(self.shard_dim, start, valid))
            start += valid
        return rows

    def cat_rows(self, rows: torch.Tensor) -> None:
        """Inverse of :meth:`rank_rows` (``d > 0``): concatenate the rank rows of an all-gather
        into the unsharded parameter's storage."""
        pieces = [rows[r, :valid * self.rest_numel].view(self._rows_shape(valid))
                  for r, valid in enumerate(self.rank_valid())]
        torch.cat(pieces, dim=self.shard_dim, out=self.unsharded_data)

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
            local = wrap_like(source, local) if self.extension else local
            self.sharded_param = nn.Parameter(DTensor(local, self.spec, requires_grad=False),
                                              requires_grad=self.requires_grad)
        else:
            current = local_tensor(self.sharded_param)
            # A replacement with a plain local tensor (load_state_dict(assign=True) of a
            # checkpoint's DTensors) keeps the extension of the tensor it replaced.
            template = current if is_extension(current) else self._bound_local
            data = extension_data(current) if self.extension and current is template else current
            if not data.is_meta and data.data_ptr() != local.data_ptr():
                local.copy_(data)
            local = wrap_like(template, local) if self.extension else local
        self._bound_local = local
        set_local_tensor(self.sharded_param, local)

    def adopt_replacement(self) -> bool:
        """Pick up what replaced the sharded parameter since the last bind: a new parameter on
        the module (``setattr``, ``load_state_dict(assign=True)``: a DTensor of the same layout)
        or a new local tensor (``module.to(dtype/device)``, ``to_empty``). Call while the
        sharded parameters are registered.

        Returns:
            True when the local shard no longer views the group's buffer (rebind needed).

        Raises:
            ValueError: the replacement is not a DTensor, or its shape or layout differs.
        """
        for module, name in self.slots:
            new = module_parameters(module).get(name)
            if new is not None and new is not self.sharded_param:
                self.sharded_param = self._as_sharded(new, name)
                self.use_sharded()
                break
        local = local_tensor(self.sharded_param)
        if local is self._bound_local:
            return False
        self.dtype = local.dtype
        self.spec = dtensor_spec(self.sharded_param)
        return True

    def _as_sharded(self, new: torch.Tensor, name: str) -> nn.Parameter:
        if tuple(new.shape) != self.global_shape:
            raise ValueError(f"parameter {name!r} was replaced by a tensor of shape "
                             f"{tuple(new.shape)}; fully_shard manages it with shape {self.global_shape}")
        if not isinstance(new, DTensor):
            # Sharding it here would make a new object, silently orphaning an optimizer that
            # already holds this one.
            raise ValueError(f"parameter {name!r} was replaced by a plain tensor after fully_shard: "
                             f"assign a DTensor on {self.spec.mesh} with placements "
                             f"{self.spec.placements} (e.g. distribute_tensor(full, param.device_mesh, "
                             "param.placements)), or load full tensors with load_state_dict")
        if new.device_mesh != self.spec.mesh or tuple(new.placements) != self.spec.placements:
            raise ValueError(f"parameter {name!r} was replaced by a DTensor on {new.device_mesh} "
                             f"with placements {tuple(new.placements)}; fully_shard manages it on "
                             f"{self.spec.mesh} with {self.spec.placements}")
        return new if isinstance(new, nn.Parameter) else nn.Parameter(new, requires_grad=new.requires_grad)

    def sharded_local(self) -> torch.Tensor:
        """The sharded parameter's local tensor (an extension's subclass, for those)."""
        return local_tensor(self.sharded_param)

    def bind_unsharded(self, padded_full_flat: torch.Tensor) -> None:
        """Create the unsharded parameter as a view of its slot in the group's unsharded buffer."""
        full = padded_full_flat[:math.prod(self.unsharded_local_shape)].view(self.unsharded_local_shape)
        self.unsharded_data = full
        self.bind_unsharded_tensor(full)

    def bind_unsharded_tensor(self, full: torch.Tensor) -> None:
        """Make ``full`` (unsharded local shape; an extension's ``fsdp_post_all_gather``
        result, or a view of the unsharded buffer) the unsharded parameter."""
        full = torch.as_strided(full, self.unsharded_local_shape, _contiguous_stride(self.unsharded_local_shape))
        if self.tp_mesh is not None:
            full = DTensor.from_local(full, self.tp_mesh, self.tp_placements, run_check=False,
                                      shape=torch.Size(self.global_shape),
                                      stride=_contiguous_stride(self.global_shape))
        self.unsharded_param = nn.Parameter(full, requires_grad=self.requires_grad)

    def reduce_scatter_input(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The unsharded gradient (plus ``accumulated_grad``; local over TP; zeros if there is
        none) in ``dtype``, in a layout whose ``_chunk_cat(dim=0, num_chunks=world)`` chunk ``r``
        is rank ``r``'s shard slot; clears both."""
        grad = self.unsharded_param.grad
        self.unsharded_param.grad = None
        if self.accumulated_grad is not None:
            if grad is not None:
                self.accumulated_grad += grad
            grad, self.accumulated_grad = self.accumulated_grad, None
        if grad is None:
            grad = torch.zeros(self.unsharded_local_shape, dtype=dtype, device=device)
        elif isinstance(grad, DTensor):
            if tuple(grad.placements) != self.tp_placements:
                grad = grad.redistribute(placements=self.tp_placements)
            grad = local_tensor(grad)
        grad = grad.to(dtype)
        return self.rank_rows(grad) if self.shard_dim else grad

    def accumulate_unreduced_grad(self, reduce_dtype: torch.dtype) -> None:
        """After a backward without gradient sync: move the unsharded gradient into
        ``accumulated_grad`` (in ``reduce_dtype``) when that dtype differs from the gradient's."""
        grad = self.unsharded_param.grad
        if grad is None or (self.accumulated_grad is None and grad.dtype == reduce_dtype):
            return
        self.unsharded_param.grad = None
        if self.accumulated_grad is None:
            self.accumulated_grad = grad.to(reduce_dtype)
        else:
            self.accumulated_grad += grad

    def accumulate_sharded_grad(self, padded_flat: torch.Tensor) -> None:
        """Set (or add to) the sharded gradient from its slot of a reduced flat buffer, then run
        the sharded parameter's post-accumulate-grad hooks (autograd never sees it)."""
        local = self._local_view(padded_flat)
        param = self.sharded_param
        if param.grad is None:
            param.grad = DTensor(local, self.spec, requires_grad=False)
        else:
            local_tensor(param.grad).add_(local)
        for hook in tuple(post_accumulate_grad_hooks(param).values()):
            hook(param)

    def use_sharded(self) -> None:
        for module, name in self.slots:
            module_parameters(module)[name] = self.sharded_param

    def shard_full(self, full: torch.Tensor) -> DTensor:
        """This rank's shard of a full (global) tensor as a DTensor like ``sharded_param``: a
        copy (never a view of ``full``, which ``load_state_dict(assign=True)`` would alias), on
        the sharded parameter's device, or on ``full``'s while that is meta (assigning into a
        meta-built model).

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
        device = local_tensor(self.sharded_param).device
        local = local.to(device=full.device if device.type == "meta" else device, dtype=self.dtype,
                         copy=True, memory_format=torch.contiguous_format)
        return DTensor(local, self.spec, requires_grad=False)
