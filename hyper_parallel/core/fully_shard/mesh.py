"""Data-parallel mesh handling: FSDP (1-D), HSDP (2-D: replicate, shard) and FSDP+TP layouts."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from hyper_parallel._torch_compat import FSDPMeshInfo, HSDPMeshInfo, mesh_dim_rank_groups, spmd_mesh_dims
from hyper_parallel.platform import get_platform

# Caches keyed by the default process group: one per process normally, one per rank when
# ranks are threads of one process (torch's threaded test harness), so that a rank never
# skips a collective group creation because another rank already cached its result.
_WORLD_MESH: "weakref.WeakKeyDictionary[dist.ProcessGroup, DeviceMesh]" = weakref.WeakKeyDictionary()
# default group -> (purpose, every group's ranks) -> this rank's group (see _group_of_every_rank)
_SUBGROUPS: "weakref.WeakKeyDictionary[dist.ProcessGroup, Dict[tuple, Optional[dist.ProcessGroup]]]" = (
    weakref.WeakKeyDictionary())


@dataclass(frozen=True)
class DataParallelMesh:
    """The data-parallel mesh of one ``fully_shard`` call and its process groups.

    ``mesh`` is 1-D (FSDP: shard) or 2-D (HSDP: dim 0 replicates, dim 1 shards).
    """

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: Optional[dist.ProcessGroup]
    replicate_size: int

    @property
    def is_hsdp(self) -> bool:
        return self.mesh.ndim == 2

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks gradients are averaged over."""
        return self.shard_size * self.replicate_size

    def shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh of this rank's shard group (what all-gather extensions are passed)."""
        if not self.is_hsdp:
            return self.mesh
        if self.mesh.mesh_dim_names is not None:
            return self.mesh[self.mesh.mesh_dim_names[-1]]
        return DeviceMesh.from_group(self.shard_group, self.mesh.device_type)

    def placements(self, shard: Placement) -> Tuple[Placement, ...]:
        return (Replicate(), shard) if self.is_hsdp else (shard,)

    def shard_subgroup(self, size: int) -> dist.ProcessGroup:
        """The group of ``size`` consecutive shard ranks (``size`` divides the shard world
        size) this rank belongs to. Collective over the root mesh (normally the world): every
        rank creates every such group of its own and its sibling meshes (see
        :func:`_group_of_every_rank`), so every rank must ask for the same sizes in the same order."""
        pieces = tuple(tuple(ranks[start:start + size]) for ranks in self._every_shard_group()
                       for start in range(0, len(ranks), size))
        return _group_of_every_rank("post_forward", pieces)

    def separate_shard_group(self) -> dist.ProcessGroup:
        """A second process group with the ranks of this rank's shard group (its reduce-scatters
        then progress alongside the all-gathers). Collective over the root mesh, as
        :meth:`shard_subgroup`."""
        return _group_of_every_rank("reduce_scatter", self._every_shard_group())

    def _every_shard_group(self) -> Tuple[Tuple[int, ...], ...]:
        """The ranks of this rank's shard group and of those of the sibling meshes (the other
        slices of the same root mesh), in mesh order: the same on every rank."""
        return tuple(map(tuple, mesh_dim_rank_groups(self.mesh, self.mesh.ndim - 1)))


def _group_of_every_rank(purpose: str, rank_sets: Tuple[Tuple[int, ...], ...]) -> Optional[dist.ProcessGroup]:
    """This rank's group among ``rank_sets`` (disjoint), created once per default group and
    ``purpose``. Every rank calling creates every group, in the same order, as torch's
    ``new_group`` requires (so does torch's DeviceMesh): a group created by its members only
    (``use_local_synchronization=True``) is, with an eagerly initialised NCCL default group, a
    split of the world communicator that only some ranks join, i.e. a hang. ``rank_sets`` is
    the same on every rank, so the ranks hit or miss this cache together."""
    cache = _SUBGROUPS.setdefault(dist.distributed_c10d._get_default_group(), {})
    key = (purpose, rank_sets)
    if key not in cache:
        rank, mine = dist.get_rank(), None
        for ranks in rank_sets:
            group = dist.new_group(list(ranks))
            if rank in ranks:
                mine = group
        cache[key] = mine
    return cache[key]


def _world_mesh() -> DeviceMesh:
    """The default mesh: 1-D over the default process group, unnamed, so that it compares equal
    to torch's default ``init_device_mesh(device_type, (world_size,))`` (one per default group)."""
    default_group = dist.distributed_c10d._get_default_group()
    mesh = _WORLD_MESH.get(default_group)
    if mesh is None:
        mesh = init_device_mesh(get_platform().device_type, (dist.get_world_size(),))
        _WORLD_MESH[default_group] = mesh
    return mesh


def resolve_mesh(mesh: Optional[DeviceMesh]) -> DataParallelMesh:
    """Validate ``mesh`` (None: the whole world) and look up its groups.

    Raises:
        RuntimeError: no default process group is initialised.
        ValueError: the mesh is not 1-D or 2-D, or its device type is not the platform's.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs an initialised process group: call "
            "hyper_parallel.init_distributed() (or torch.distributed.init_process_group) first"
        )
    mesh = _world_mesh() if mesh is None else mesh
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh} ({mesh.ndim}-D): 1-D for "
            f"FSDP, 2-D (replicate, shard) for HSDP"
        )
    device_type = get_platform().device_type
    if mesh.device_type != device_type:
        raise ValueError(
            f"mesh device type {mesh.device_type!r} does not match the platform's {device_type!r}"
        )
    shard_dim = mesh.ndim - 1
    hsdp = mesh.ndim == 2
    return DataParallelMesh(
        mesh=mesh,
        shard_group=mesh.get_group(shard_dim),
        shard_size=mesh.size(shard_dim),
        shard_rank=mesh.get_local_rank(shard_dim),
        replicate_group=mesh.get_group(0) if hsdp else None,
        replicate_size=mesh.size(0) if hsdp else 1,
    )


def resolve_mesh_info(mesh_info: object) -> DataParallelMesh:
    """The mesh of a ``ShardPlacementResult`` (FSDP2's per-parameter mesh): an
    ``FSDPMeshInfo`` on a 1-D mesh (FSDP) or an ``HSDPMeshInfo`` on a 2-D mesh whose dim 0
    replicates and dim 1 shards (HSDP).

    Raises:
        ValueError: another object, another layout of the dims, or torch's full-SPMD-mesh
            form (``dp_mesh_dims``).
    """
    if not isinstance(mesh_info, FSDPMeshInfo):
        raise ValueError(f"ShardPlacementResult.mesh_info must be torch's FSDPMeshInfo or HSDPMeshInfo, "
                         f"got {type(mesh_info).__name__}")
    mesh = mesh_info.mesh
    if spmd_mesh_dims(mesh_info) is not None:
        raise ValueError(f"ShardPlacementResult with dp_mesh_dims={spmd_mesh_dims(mesh_info)!r} is not supported: "
                         "describe the data-parallel sub-mesh itself")
    if isinstance(mesh_info, HSDPMeshInfo):
        layout_ok = mesh.ndim == 2 and (mesh_info.replicate_mesh_dim, mesh_info.shard_mesh_dim) == (0, 1)
        wanted = "HSDPMeshInfo(mesh=<2-D mesh>, replicate_mesh_dim=0, shard_mesh_dim=1)"
    else:
        layout_ok = mesh.ndim == 1 and mesh_info.shard_mesh_dim == 0
        wanted = "FSDPMeshInfo(mesh=<1-D mesh>, shard_mesh_dim=0)"
    if not layout_ok:
        raise ValueError(f"unsupported ShardPlacementResult mesh: {type(mesh_info).__name__} with "
                         f"shard_mesh_dim={mesh_info.shard_mesh_dim} on a {mesh.ndim}-D mesh; use {wanted}")
    return resolve_mesh(mesh)


def sharded_layout(dp: DataParallelMesh, shard_dim: int, tp_mesh: Optional[DeviceMesh] = None,
                   tp_placements: Tuple[Placement, ...] = ()) -> Tuple[DeviceMesh, Tuple[Placement, ...]]:
    """Mesh and placements of a sharded parameter.

    Plain parameters get ``dp.mesh`` with ``(Shard(d),)`` / ``(Replicate(), Shard(d))``. A
    tensor-parallel DTensor parameter gets the data-parallel dims prepended to its own mesh and
    placements; when TP already shards dim ``d``, the data-parallel shard is a ``_StridedShard``
    (the data-parallel split happens inside each TP shard).

    Raises:
        ValueError: the TP mesh cannot be joined with the data-parallel mesh.
    """
    if tp_mesh is None:
        return dp.mesh, dp.placements(Shard(shard_dim))
    split_factor = 1
    for size, placement in zip(tp_mesh.shape, tp_placements):
        if isinstance(placement, Shard) and placement.dim == shard_dim:
            split_factor *= size
    dp_shard = _StridedShard(shard_dim, split_factor=split_factor) if split_factor > 1 else Shard(shard_dim)
    if dp.mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
        raise ValueError("FSDP+TP needs named meshes: slice both the data-parallel and the "
                         "tensor-parallel mesh from one init_device_mesh(..., mesh_dim_names=...)")
    try:
        spmd_mesh = DeviceMesh._concatenate([dp.mesh, tp_mesh])
    except RuntimeError as err:
        raise ValueError(f"cannot combine data-parallel mesh {dp.mesh} with the parameter's "
                         f"tensor-parallel mesh {tp_mesh}: {err}") from err
    return spmd_mesh, (*dp.placements(dp_shard), *tp_placements)
