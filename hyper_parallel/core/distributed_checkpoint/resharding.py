"""Chunk geometry: which global box a (D)Tensor holds, who else holds it (:func:`mesh_slot`),
box overlaps, and where a box lies inside a stored row-major chunk."""

from __future__ import annotations

import functools
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from hyper_parallel._torch_compat import compute_local_shape_and_global_offset

from hyper_parallel.core.distributed_checkpoint.metadata import ChunkStorageMetadata


def local_chunk(value: torch.Tensor) -> ChunkStorageMetadata:
    """The global box this rank holds: its DTensor shard, or the whole plain tensor."""
    if isinstance(value, DTensor):
        sizes, offsets = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        return ChunkStorageMetadata(tuple(offsets), tuple(sizes))
    return ChunkStorageMetadata((0,) * value.dim(), tuple(value.shape))


def local_data(value: torch.Tensor) -> torch.Tensor:
    """The tensor that holds this rank's chunk (the DTensor's local shard)."""
    return value.to_local() if isinstance(value, DTensor) else value


class MeshSlot(NamedTuple):
    """This rank's place in a DTensor's mesh under its placements: what planning asks of the
    mesh, computed once per (mesh, placements, coordinate) by :func:`mesh_slot`."""

    replicas: Tuple[int, ...]
    """Global ranks holding exactly this rank's chunk (same coordinate on every non-Replicate
    mesh dim), in mesh order; empty if this rank is not in the mesh."""
    lowest: int
    """The lowest global rank of the mesh."""
    broadcast_dim: Optional[int]
    """The first Replicate mesh dim with more than one rank (replicated shards are read on its
    coordinate 0 and broadcast along it), or None."""
    broadcast_ranks: Tuple[int, ...]
    """Global ranks along ``broadcast_dim`` through this rank, in mesh order (the first one reads)."""


def mesh_slot(value: DTensor) -> MeshSlot:
    """:class:`MeshSlot` of ``value`` on this rank (cached: the mesh's rank tensor is built once
    per mesh layout, placements and coordinate, not once per tensor)."""
    mesh = value.device_mesh
    return _mesh_slot(mesh, tuple(value.placements), mesh.get_coordinate())


@functools.lru_cache(maxsize=256)
def _mesh_slot(mesh: DeviceMesh, placements: Tuple[Placement, ...], coordinate: Optional[Tuple[int, ...]]) -> MeshSlot:
    ranks = mesh.mesh
    lowest = int(ranks.min())
    if coordinate is None:
        return MeshSlot((), lowest, None, ())
    replicas = ranks[tuple(slice(None) if p.is_replicate() else c for p, c in zip(placements, coordinate))]
    dims = [d for d, p in enumerate(placements) if p.is_replicate() and ranks.shape[d] > 1]
    if not dims:
        return MeshSlot(tuple(replicas.flatten().tolist()), lowest, None, ())
    along = ranks[tuple(slice(None) if d == dims[0] else c for d, c in enumerate(coordinate))]
    return MeshSlot(tuple(replicas.flatten().tolist()), lowest, dims[0], tuple(along.tolist()))


def numel(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def overlap(
    dest: ChunkStorageMetadata, stored: ChunkStorageMetadata
) -> Optional[Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]]:
    """The common box of two global boxes, or None if they do not intersect.

    Returns ``(dest_offsets, storage_offsets, lengths)``: the box's start relative to each
    chunk and its size.
    """
    dest_offsets, storage_offsets, lengths = [], [], []
    for d_off, d_size, s_off, s_size in zip(dest.offsets, dest.sizes, stored.offsets, stored.sizes):
        lo, hi = max(d_off, s_off), min(d_off + d_size, s_off + s_size)
        if hi <= lo:
            return None
        dest_offsets.append(lo - d_off)
        storage_offsets.append(lo - s_off)
        lengths.append(hi - lo)
    return tuple(dest_offsets), tuple(storage_offsets), tuple(lengths)


def narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """View of ``tensor`` restricted to the box ``offsets``/``lengths``."""
    for dim, (off, length) in enumerate(zip(offsets, lengths)):
        if off != 0 or length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, off, length)
    return tensor


class BoxGeometry:
    """Where a box (``offsets``/``lengths``) of a row-major chunk of ``sizes`` lies, in
    elements from the chunk's start, and the contiguous runs it is made of."""

    def __init__(self, sizes: Tuple[int, ...], offsets: Tuple[int, ...], lengths: Tuple[int, ...]) -> None:
        self.offsets, self.lengths = offsets, lengths
        self.strides = [1] * len(sizes)
        for d in range(len(sizes) - 2, -1, -1):
            self.strides[d] = self.strides[d + 1] * sizes[d + 1]
        self.first = sum(o * s for o, s in zip(offsets, self.strides))
        self.span = sum((n - 1) * s for n, s in zip(lengths, self.strides)) + 1
        self.volume = numel(lengths)
        self.contiguous = self.span == self.volume
        # Runs: the box's contiguous pieces, spanning every dim from the last partial one on.
        partial = [d for d, (n, size) in enumerate(zip(lengths, sizes)) if n != size]
        self.run_dim = partial[-1] if partial else 0
        self.run = numel(lengths[self.run_dim:])

    def run_starts(self) -> List[int]:
        """Element offset of every run, in the box's row-major order."""
        starts = torch.tensor([self.first], dtype=torch.int64)
        for n, stride in zip(self.lengths[:self.run_dim], self.strides[:self.run_dim]):
            starts = (starts[:, None] + torch.arange(n, dtype=torch.int64) * stride).reshape(-1)
        return starts.tolist()
