"""``fully_shard(mesh=None)`` shards over torch's default mesh, as torch's ``fully_shard`` does."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import hyper_parallel as hp
from tests.multirank import run_on_ranks


def _default_mesh_matches_torch() -> bool:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    hp.fully_shard(model[0])
    hp.fully_shard(model)
    # torch's default: init_device_mesh(device_type, (world_size,)), no dim names.
    torch_default = init_device_mesh("cpu", (dist.get_world_size(),))
    meshes = {param.device_mesh for param in model.parameters()}
    assert meshes == {torch_default}, (meshes, torch_default)
    return all(param.device_mesh.mesh_dim_names is None for param in model.parameters())


def test_default_mesh_equals_torchs_default_mesh():
    assert run_on_ranks(2, _default_mesh_matches_torch, timeout=120) == [True, True]
