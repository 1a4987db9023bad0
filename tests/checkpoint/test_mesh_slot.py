"""``planning/shards.mesh_slot``: what planning asks of a DTensor's mesh, right for every rank of
every layout, and computed once per mesh layout rather than once per tensor (torch's
``fake`` process group, meta tensors)."""

import math

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

import hyper_parallel.checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.planning.shards import mesh_slot
from tests.checkpoint.helpers import META_LAYOUTS, meta_state


def _brute_force(value):
    """The slot from the full rank list: replicas share every non-Replicate coordinate; the
    broadcast group is the mesh's own process group along the first Replicate dim of size > 1."""
    mesh, placements = value.device_mesh, value.placements
    shape, ranks, coordinate = tuple(mesh.shape), mesh.mesh.flatten().tolist(), mesh.get_coordinate()
    coords = [tuple(i // math.prod(shape[d + 1:]) % shape[d] for d in range(len(shape))) for i in range(len(ranks))]
    replicas = tuple(r for r, c in zip(ranks, coords)
                     if all(p.is_replicate() or c[d] == coordinate[d] for d, p in enumerate(placements)))
    dims = [d for d, p in enumerate(placements) if p.is_replicate() and shape[d] > 1]
    along = tuple(dist.get_process_group_ranks(mesh.get_group(dims[0]))) if dims else ()
    return replicas, min(ranks), dims[0] if dims else None, along


@pytest.mark.parametrize("layout", sorted(META_LAYOUTS))
def test_slot_matches_the_mesh_on_every_rank(fake_process_group, layout):
    for rank in range(math.prod(META_LAYOUTS[layout][0])):
        value = meta_state(layout, rank)["w"]
        assert tuple(mesh_slot(value)) == _brute_force(value), (layout, rank)


def test_planning_reads_the_mesh_once_not_per_tensor(fake_process_group, monkeypatch):
    """Save and load planning of 40 DTensors on one HSDP mesh build its rank tensor at most
    once (it was once per tensor in each planner)."""
    state = meta_state("hsdp", rank=4)
    state.update({f"extra{i}": state["w"] for i in range(36)})
    built = []
    mesh_property = DeviceMesh.mesh
    monkeypatch.setattr(DeviceMesh, "mesh", property(lambda self: built.append(1) or mesh_property.fget(self)))
    planner = hdcp.StandardSavePlanner()
    planner.configure_planner(state, rank=4)
    assert planner.build_local_plan().items  # (rank 4 writes some of the replicated chunks)
    # Rank 4 (coordinate (1, 1)) receives every tensor from rank 1: no chunk is read.
    metadata = hdcp.Metadata({k: hdcp.TensorStorageMetadata(v.dtype, tuple(v.shape)) for k, v in state.items()})
    loader = hdcp.StandardLoadPlanner()
    loader.configure_planner(state, metadata, rank=4, use_collectives=True)
    assert loader.build_local_plan().items == []
    assert [src for _, src, _ in loader.broadcasts()] == [1] * len(state)
    assert len(built) <= 1, f"the mesh's rank tensor was built {len(built)} times for {len(state)} tensors"
