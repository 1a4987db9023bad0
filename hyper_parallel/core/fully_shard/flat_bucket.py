"""FlatBucket: the parameters of one fully_shard group that share a dtype, as flat buffers.

One flat shard buffer (the parameters' padded shards are views into it, so it is the
all-gather input with no copy-in), one all-gather into a rank-major flat buffer, one
``split_with_sizes_copy`` copy-out into the parameter-major unsharded buffer (the unsharded
parameters are views into it; its storage is freed on reshard and refilled in place before
backward; parameters sharded on a dim > 0 take one more ``cat`` from a temporary), and one
``_chunk_cat``-ed reduce-scatter input per backward. The group (``param_group.py``) decides the
collectives' ordering, streams and state; the bucket owns the buffers and their layout.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from hyper_parallel._torch_compat import chunk_cat, preserve_version_counter
from hyper_parallel.core.fully_shard import collectives
from hyper_parallel.core.fully_shard.param import HSDPParam
from hyper_parallel.core.fully_shard.policy import MixedPrecisionPolicy


class FlatBucket:
    """The parameters of one group with one (dtype, compute dtype): their flat shard buffer,
    unsharded buffer, all-gather copy-in/out and reduce-scatter input/output."""

    def __init__(self, params: List[HSDPParam], world: int, mp: MixedPrecisionPolicy,
                 compute_dtype: Optional[torch.dtype]):
        self.params = params
        self.world = world
        self.dtype = params[0].dtype
        self.compute_dtype = compute_dtype or self.dtype
        self.reduce_dtype = mp.reduce_dtype or self.compute_dtype
        self.sizes = [p.shard_numel for p in params]
        self.total = sum(self.sizes)
        self.update_trainable()
        self.shard_flat: Optional[torch.Tensor] = None
        self.unsharded_flat: Optional[torch.Tensor] = None
        self._copy_out_views: List[torch.Tensor] = []
        self.partial_grad: Optional[torch.Tensor] = None  # HSDP: reduce-scattered, not all-reduced
        # Which trainable parameters had a gradient on this rank since the last assign_grads.
        self.local_grads: Optional[List[bool]] = None
        self.gathered_version = -1  # _shard_version() at the last all-gather
        self.device: Optional[torch.device] = None  # of the unsharded parameters, once bound

    def update_trainable(self) -> None:
        """Take the parameters' current ``requires_grad``: frozen ones are not reduced."""
        self.trainable = [p for p in self.params if p.requires_grad]
        self.grad_sizes = [p.shard_numel for p in self.trainable]
        self.grad_total = sum(self.grad_sizes)
        self.reduced_numel = self.grad_total + len(self.trainable)  # + one presence flag each

    def _shard_version(self) -> int:
        # In-place updates of a DTensor bump the wrapper's version counter, not the local
        # tensor's (they run below autograd); counters only grow, so the sum detects any change.
        return sum(p.sharded_param._version for p in self.params)

    @property
    def stale(self) -> bool:
        """The shards changed (optimizer step, load) since they were all-gathered."""
        return self._shard_version() != self.gathered_version

    def bind_shards(self, device: torch.device, pin: bool) -> None:
        """(Re)allocate the flat shard buffer on ``device`` if needed; point every parameter's
        local shard into it, keeping current values."""
        pin = pin and device.type == "cpu"
        current = self.shard_flat
        if current is None or current.device != device or (pin and not current.is_pinned()):
            self.shard_flat = torch.zeros(self.total, dtype=self.dtype, device=device, pin_memory=pin)
        for param, piece in zip(self.params, self.shard_flat.split(self.sizes)):
            param.bind_shard(piece)

    def bind_unsharded(self, device: torch.device) -> None:
        self.device = device
        self.unsharded_flat = torch.empty(self.world * self.total, dtype=self.compute_dtype, device=device)
        segments = self.unsharded_flat.split([self.world * n for n in self.sizes])
        self._copy_out_views = [seg.view(self.world, n) for seg, n in zip(segments, self.sizes)]
        for param, segment in zip(self.params, segments):
            param.bind_unsharded(segment)
        self.free_unsharded()

    def all_gather(self, group: dist.ProcessGroup, device: torch.device, async_op: bool):
        """Issue the all-gather of the flat shard; returns (work, rank-major result) for
        :meth:`copy_out`. One rank: no collective, the shard is the result."""
        self.gathered_version = self._shard_version()
        shard = self.shard_flat.to(device=device, dtype=self.compute_dtype, non_blocking=True)
        if self.world == 1:
            return None, shard.view(1, self.total)
        output = torch.empty(self.world * self.total, dtype=self.compute_dtype, device=device)
        work = collectives.all_gather(output, shard, group, async_op)
        return work, output.view(self.world, self.total)

    def _destinations(self) -> List[torch.Tensor]:
        """Copy-out targets, ``(world, n)`` each: the unsharded segments for dim-0 parameters,
        temporaries (concatenated by :meth:`copy_out`) for the others."""
        return [torch.empty_like(view) if param.shard_dim else view
                for param, view in zip(self.params, self._copy_out_views)]

    def post_forward_piece(self, size: int, sub_rank: int) -> torch.Tensor:
        """What this rank keeps after forward when resharding to groups of ``size`` ranks: the
        shards of ranks ``sub_rank, sub_rank + size, ...`` as a ``(world // size, total)`` block."""
        rows = [param.rank_rows(param.unsharded_data) if param.shard_dim else view
                for param, view in zip(self.params, self._copy_out_views)]
        return torch.cat([r[sub_rank::size] for r in rows], dim=1)

    def all_gather_pieces(self, piece: torch.Tensor, group: dist.ProcessGroup, size: int, async_op: bool):
        """Rebuild the unsharded parameters from post-forward pieces over a ``size``-rank group."""
        output = torch.empty(self.world * self.total, dtype=self.compute_dtype, device=piece.device)
        work = collectives.all_gather(output, piece.view(-1), group, async_op)
        rows = self.world // size
        # Gathered row (j, m) is rank m * size + j's shard.
        gathered = output.view(size, rows, self.total).transpose(0, 1)
        return work, gathered

    def copy_out(self, gathered: torch.Tensor) -> None:
        """Fill the unsharded parameters from an all-gather result, ``(world, total)`` or
        ``(world // size, size, total)`` (post-forward pieces); on the compute stream, which
        also allocates the temporaries (an all-gather stream allocation freed here could be
        handed to the next all-gather while this copy still runs)."""
        storage = self.unsharded_flat.untyped_storage()
        nbytes = self.unsharded_flat.numel() * self.unsharded_flat.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        destinations = [d.view(*gathered.shape[:-1], -1) for d in self._destinations()]
        # Autograd saved the unsharded params in forward; refilling the same storage before
        # backward is intended, so the version counter must not change.
        with torch.no_grad(), preserve_version_counter(self.unsharded_flat):
            torch.split_with_sizes_copy(gathered, self.sizes, dim=-1, out=destinations)
            for param, rows in zip(self.params, destinations):
                if param.shard_dim:
                    param.cat_rows(rows.view(self.world, -1))

    def free_unsharded(self) -> None:
        self.unsharded_flat.untyped_storage().resize_(0)

    def gradient_input(self) -> Optional[torch.Tensor]:
        """Unsharded grads of the trainable parameters as one rank-major flat reduce-scatter
        input, zeros (with presence flags 0) for those without one (None: no trainable
        parameters). Clears the unsharded grads."""
        if not self.trainable:
            return None
        present = [p.unsharded_param.grad is not None or p.accumulated_grad is not None for p in self.trainable]
        if self.local_grads is not None:  # HSDP partial sum pending
            present = [a or b for a, b in zip(self.local_grads, present)]
        self.local_grads = present
        device = self.device
        accumulated = any(p.accumulated_grad is not None for p in self.trainable)
        dtype = self.reduce_dtype if accumulated else self.compute_dtype
        grads = [p.reduce_scatter_input(dtype, device) for p in self.trainable]
        # [Note: gradient presence flags] Every rank slot ends with one flag per parameter
        # (1: this rank had a gradient). After the reduction a flag is > 0 iff some rank had
        # one, so a rank without a gradient of its own still agrees with the others on whether
        # the sharded gradient is set (FSDP2 leaves it None when no rank computed one).
        if all(present):  # the usual case: a fill, no host-to-device copy
            flags = torch.ones(self.world, len(present), dtype=dtype, device=device)
        else:
            flags = torch.tensor(present, dtype=dtype, device=device).repeat(self.world, 1)
        flat = chunk_cat(grads + [flags], dim=0, num_chunks=self.world)
        return flat.to(self.reduce_dtype).view(-1)

    def accumulate_unreduced_grads(self) -> None:
        """A backward without gradient sync: sum the unsharded grads in the reduce dtype."""
        if self.reduce_dtype != self.compute_dtype:
            for param in self.trainable:
                param.accumulate_unreduced_grad(self.reduce_dtype)

    def take_local_grads(self) -> List[bool]:
        """Which trainable parameters had a gradient on this rank in the reduction finishing
        now (for :meth:`assign_grads`); the next reduction starts afresh."""
        local, self.local_grads = self.local_grads, None
        return local

    def assign_grads(self, reduced: torch.Tensor, local: List[bool]) -> None:
        """Set the sharded gradients from a reduced flat buffer (see [Note: gradient presence
        flags]); parameters no rank computed a gradient for keep ``grad = None``. ``local``:
        :meth:`take_local_grads` of the reduction."""
        grads, flags = reduced.split([self.grad_total, len(self.trainable)])
        # Only a parameter without a local gradient needs the flags (a device-to-host read).
        agreed = (flags > 0).tolist() if not all(local) else local
        grads = grads.to(self.dtype)
        for param, piece, has_grad in zip(self.trainable, grads.split(self.grad_sizes), agreed):
            if has_grad:
                param.accumulate_sharded_grad(piece)
