"""Where a DTensor's shard lies in the full tensor, and this rank's part of a full tensor in a
DTensor's layout, computed locally (no communication)."""

from __future__ import annotations

from typing import Tuple

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from hyper_parallel._torch_compat import compute_local_shape_and_global_offset


def local_box(like: DTensor) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """``(sizes, offsets)`` of this rank's shard of ``like`` in its global shape."""
    sizes, offsets = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    return tuple(sizes), tuple(offsets)


def local_part(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's part of ``full`` (a tensor of ``like``'s global shape) in the layout of
    ``like``, on ``like``'s device. Shard/Replicate layouts are sliced out (a view where
    ``full`` is already there); others go through ``distribute_tensor`` without a scatter."""
    if all(type(p) in (Shard, Replicate) for p in like.placements):
        sizes, offsets = local_box(like)
        for dim, (size, start) in enumerate(zip(sizes, offsets)):
            full = full.narrow(dim, start, size)
        return full.to(like.device)
    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None).to_local()
