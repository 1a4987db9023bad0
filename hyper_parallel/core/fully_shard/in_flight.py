"""The records of a parameter group's side-stream work in flight (``param_group.py``), and of
the shards kept for a side-stream reader: what each holds, and until when, is what keeps the
caching allocator from handing a buffer to another stream while a collective or copy still
reads it (docs/fully_shard.md, "Streams"); and UnshardHandle, the user's handle on an
all-gather in flight."""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Protocol

import torch
import torch.distributed as dist

from hyper_parallel.core.fully_shard.flat_bucket import FlatBucket
from hyper_parallel.core.fully_shard.mesh_subgroup import MeshSubgroup


class PostForwardShards(NamedTuple):
    """The shards of the smaller group kept after forward (``reshard_after_forward=<int>``,
    state ``SHARDED_POST_FORWARD``), cut on the compute stream; the backward all-gather (or a
    prefetch) reads them on the all-gather stream, and its InFlightGather takes them over."""

    # One per bucket; None for a bucket whose mesh resharded fully (its shard world is the
    # smaller group's size): gathered from its shards again.
    pieces: List[Optional[torch.Tensor]]
    written: Optional[Any]  # compute-stream event after the cut: the all-gather stream waits for it


class InFlightGather(NamedTuple):
    """A bucket's all-gather, issued on the all-gather stream."""

    bucket: FlatBucket
    work: Optional[dist.Work]  # None: issued in stream order (accelerators), synchronous, or one rank
    # Rank-major result, allocated on the all-gather stream and read by the copy-out on the
    # compute stream, then handed back to the all-gather stream (Streams.free_after_use).
    gathered: torch.Tensor
    event: Optional[Any]  # all-gather stream's work (the copy-in cast) done; the copy-out waits
    # The all-gather's input where the compute stream allocated it (the pieces kept after
    # forward, reshard_after_forward=<int>), else None: the process group holds no reference
    # to it, so it is kept here until the compute stream has waited for the all-gather
    # (wait_for_unshard), or its memory could be handed to the compute stream's next kernels
    # before the all-gather read it (FSDP2 frees it in to_unsharded, after the copy-out).
    source: Optional[torch.Tensor]


class PendingReduce(NamedTuple):
    """A bucket's reduce-scatter (then, for HSDP, all-reduce) in flight."""

    mesh: MeshSubgroup  # the bucket's mesh: its replicate group and gradient divisor
    bucket: FlatBucket
    work: Optional[dist.Work]  # CPU (gloo): the host waits on it; None: stream ordered, or no collective
    event: Optional[Any]  # the reduce-scatter stream's collective done; the compute stream waits
    # The collective's input while it may still be read there: dropped once the compute stream
    # waited for the reduce-scatter (an HSDP all-reduce reads only the output). None on CPU:
    # see Streams.hold_for_collective.
    grad_input: Optional[torch.Tensor]
    output: torch.Tensor  # allocated on the compute stream, which sets it as the gradients


class OffloadedGrads(NamedTuple):
    """A bucket's reduced gradients on their way to host memory (CPU offload)."""

    bucket: FlatBucket
    host: torch.Tensor  # the copy's destination (pinned where the platform has pinned memory)
    # The device gradients the copy reads, held until the compute stream waited for the copy
    # (GradOffload.release_sources) or the host did.
    source: Optional[torch.Tensor]
    local: List[bool]  # FlatBucket.take_local_grads() of this reduction
    event: Optional[Any]  # the copy done (reduce-scatter stream); the host waits once, at the end


class Unsharding(Protocol):
    """What an :class:`UnshardHandle` needs of its parameter group (``HSDPParamGroup``)."""

    def wait_for_unshard(self) -> None:
        """Wait for the group's all-gather and copy its output into the unsharded parameters."""


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``: ``wait()`` finishes the all-gather."""

    def __init__(self, group: Unsharding):
        self._group = group

    def wait(self) -> None:
        self._group.wait_for_unshard()
