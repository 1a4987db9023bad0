"""Which global box of a tensor this rank holds (its DTensor shard, or all of a plain tensor),
and who else holds the same box (:func:`mesh_slot`): what the planners ask of a DTensor's mesh."""

from __future__ import annotations

import weakref
from typing import Dict, NamedTuple, Optional, Tuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from hyper_parallel.core.distributed_checkpoint.format.chunk_table import ChunkStorageMetadata
from hyper_parallel.core.layout import local_box


def local_chunk(value: torch.Tensor) -> ChunkStorageMetadata:
    """The global box this rank holds: its DTensor shard, or the whole plain tensor."""
    if isinstance(value, DTensor):
        sizes, offsets = local_box(value)
        return ChunkStorageMetadata(offsets, sizes)
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
    per mesh, placements and coordinate, not once per tensor). The cache holds a mesh only as
    long as something else does: a mesh keeps its process groups alive (and, with gloo, their
    threads)."""
    mesh = value.device_mesh
    per_mesh = _MESH_SLOTS.setdefault(mesh, {})
    key = (tuple(value.placements), mesh.get_coordinate())
    if key not in per_mesh:
        per_mesh[key] = _mesh_slot(mesh, *key)
    return per_mesh[key]


# Meshes compare by value: an equal mesh made later finds the same (equal) slots.
_MESH_SLOTS: "weakref.WeakKeyDictionary[DeviceMesh, Dict[tuple, MeshSlot]]" = weakref.WeakKeyDictionary()


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
