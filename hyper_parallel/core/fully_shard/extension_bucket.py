"""ExtensionBucket: a group's all-gather extension parameters (extension_protocol.py), gathered
as bytes so that float8 (or any dtype) travels on every backend."""

from __future__ import annotations

import itertools
import math
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from hyper_parallel._torch_compat import preserve_version_counter
from hyper_parallel.core.fully_shard import collectives
from hyper_parallel.core.fully_shard.extension_protocol import call_pre_all_gather
from hyper_parallel.core.fully_shard.flat_bucket import FlatBucket
from hyper_parallel.core.fully_shard.param import HSDPParam
from hyper_parallel.core.fully_shard.policy import MixedPrecisionPolicy

# Every input starts at a multiple of this many bytes in a rank's row, so that its bytes can be
# viewed as its dtype in place (a view needs an offset divisible by the element size).
_ALIGN = 16


class _Input:
    """Layout of one all-gather input of one parameter: the input with dim ``d`` padded to the
    parameter's ``chunk`` rows (zeros after this rank's rows, as in its shard slot)."""

    def __init__(self, param: HSDPParam, tensor: torch.Tensor, name: str):
        d = param.shard_dim
        if tensor.ndim <= d or tensor.shape[d] not in (param.valid, param.chunk):
            raise ValueError(
                f"fsdp_pre_all_gather of {name!r} returned a tensor of shape {tuple(tensor.shape)}: "
                f"all-gather inputs must keep the shard's {param.valid} (or padded {param.chunk}) "
                f"entries on the shard dim {d}")
        self.dtype = tensor.dtype
        padded = list(tensor.shape)
        padded[d] = param.chunk
        self.padded_shape = tuple(padded)
        self.nbytes = math.prod(padded) * tensor.element_size()
        self.slot = -(-self.nbytes // _ALIGN) * _ALIGN  # its bytes in a rank's row
        full = list(tensor.shape)
        full[d] = param.unsharded_local_shape[d]
        self.full_shape = tuple(full)

    def typed(self, raw: torch.Tensor) -> torch.Tensor:
        """``raw`` bytes (``nbytes`` on the last dim: one rank's, or every rank's rows) as this
        input's dtype and padded shape, without a copy."""
        return raw.view(self.dtype).reshape(*raw.shape[:-1], *self.padded_shape)


class ExtensionBucket(FlatBucket):
    """The extension parameters of one group with one (dtype, compute dtype). Shards and
    gradients are laid out as in :class:`FlatBucket` (so reduce-scatter, offload and state
    dicts are unchanged); the all-gather copies each parameter's ``fsdp_pre_all_gather``
    tensors as bytes into one flat ``uint8`` input and, after it, hands each parameter its
    gathered tensors for ``fsdp_post_all_gather``: the first time to build the unsharded
    parameter, later in place (``out=``) into the same buffers."""

    def __init__(self, params: List[HSDPParam], world: int, mp: MixedPrecisionPolicy,
                 compute_dtype: Optional[torch.dtype], mesh: DeviceMesh):
        super().__init__(params, world, mp, compute_dtype)
        self.mp = mp
        self.mesh = mesh
        self._layouts: List[List[_Input]] = []
        self._metadata: List[Any] = []
        self._outputs: List[List[torch.Tensor]] = []  # per parameter: full gathered tensors
        self._inner: List[Sequence[torch.Tensor]] = []  # what post_all_gather said it allocated
        self._offsets: List[int] = []  # of each input in a rank's row of the gathered bytes

    def bind_unsharded(self, device: torch.device) -> None:
        self.device = device
        self._outputs, self._inner, self._layouts = [], [], []
        for param in self.params:
            param.unsharded_param = param.unsharded_data = None  # built by the next gather

    def all_gather(self, group: dist.ProcessGroup, device: torch.device, async_op: bool):
        self.gathered_version = self._shard_version()
        layouts, metadata, inputs = [], [], []
        for param in self.params:
            local = param.sharded_local()
            if local.device != device:  # CPU offload: the hook sees the device copy
                local = local.to(device, non_blocking=True)
            module, name = param.slots[0]
            tensors, meta = call_pre_all_gather(local, self.mesh, param.unsharded_local_shape, module, self.mp)
            layouts.append([_Input(param, t, name) for t in tensors])
            metadata.append(meta)
            inputs.append(tensors)
        if self._layouts and [[(x.dtype, x.nbytes) for x in lay] for lay in layouts] != \
                [[(x.dtype, x.nbytes) for x in lay] for lay in self._layouts]:
            raise RuntimeError("fsdp_pre_all_gather changed the number, dtypes or sizes of its "
                               "all-gather inputs between iterations")
        self._layouts, self._metadata = layouts, metadata
        self._offsets = list(itertools.accumulate((x.slot for lay in layouts for x in lay), initial=0))
        row_bytes = self._offsets.pop()
        # The input is this rank's row of the output (no separate input buffer, one copy in).
        output = torch.empty(self.world * row_bytes, dtype=torch.uint8, device=device)
        rank = dist.get_rank(group) if self.world > 1 else 0
        shard = output.narrow(0, rank * row_bytes, row_bytes)
        slots = iter(self._offsets)
        for param, layout, tensors in zip(self.params, layouts, inputs):
            for lay, tensor in zip(layout, tensors):
                slot = lay.typed(shard.narrow(0, next(slots), lay.nbytes))
                rows = tensor.shape[param.shard_dim]
                if rows != param.chunk:  # zeros after this rank's rows, as in its shard slot
                    slot.narrow(param.shard_dim, rows, param.chunk - rows).zero_()
                slot.narrow(param.shard_dim, 0, rows).copy_(tensor)
        if self.world == 1:
            return None, output.view(1, -1)
        work = collectives.all_gather(output, shard, group, async_op)
        return work, output.view(self.world, -1)

    def copy_out(self, gathered: torch.Tensor) -> None:
        first = not self._outputs
        if first:
            self._outputs = [[torch.empty(x.full_shape, dtype=x.dtype, device=self.device) for x in lay]
                             for lay in self._layouts]
        else:
            for tensor in [t for ts in self._outputs for t in ts] + [t for ts in self._inner for t in ts]:
                _alloc_storage(tensor)
        offsets = iter(self._offsets)
        with torch.no_grad():
            for param, layout, outputs in zip(self.params, self._layouts, self._outputs):
                for lay, out in zip(layout, outputs):
                    # Autograd may have saved the unsharded parameter (refilled before backward).
                    with preserve_version_counter(out):
                        _fill(param, lay.typed(gathered.narrow(-1, next(offsets), lay.nbytes)), out)
        for i, param in enumerate(self.params):
            dtype = self.compute_dtype
            if first:
                unsharded, inner = param.sharded_local().fsdp_post_all_gather(
                    tuple(self._outputs[i]), self._metadata[i], dtype)
                self._inner.append(tuple(inner))
                param.bind_unsharded_tensor(unsharded)
            else:
                param.sharded_local().fsdp_post_all_gather(
                    tuple(self._outputs[i]), self._metadata[i], dtype, out=param.unsharded_param)
        self._metadata = []

    def free_unsharded(self) -> None:
        for tensor in [t for ts in self._outputs for t in ts] + [t for ts in self._inner for t in ts]:
            tensor.untyped_storage().resize_(0)

    def post_forward_piece(self, size: int, sub_rank: int) -> torch.Tensor:
        raise NotImplementedError("reshard_after_forward=<int> is not supported with all-gather "
                                  "extensions (FSDP2 does not support it either)")


def _fill(param: HSDPParam, typed: torch.Tensor, out: torch.Tensor) -> None:
    """Rank-major rows (``world`` x padded input, a view of the gathered bytes) into ``out``
    (the full input): each rank's valid rows, concatenated on the shard dim (the one copy out)."""
    pieces = [typed[r].narrow(param.shard_dim, 0, valid) for r, valid in enumerate(param.rank_valid())]
    torch.cat(pieces, dim=param.shard_dim, out=out)


def _alloc_storage(tensor: torch.Tensor) -> None:
    nbytes = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    storage = tensor.untyped_storage()
    if storage.nbytes() != nbytes:
        storage.resize_(nbytes)
