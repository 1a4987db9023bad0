"""Errors of fully_shard name the offending parameter (and mesh), in torch's wording where
torch's FSDP2 tests check it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import hyper_parallel as hp
from tests.multirank import run_on_ranks


def _error(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    return str(info.value)


def _errors() -> list:
    model = nn.Sequential(nn.Linear(4, 4))
    model.register_parameter("scalar_p", nn.Parameter(torch.tensor(1.0)))
    zero_dim = _error(lambda: hp.fully_shard(model))
    bad_dim = _error(lambda: hp.fully_shard(nn.Sequential(nn.Linear(4, 4)),
                                            shard_placement_fn=lambda p: Shard(1)))
    mesh_3d = _error(lambda: hp.fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (2, 1, 1))))
    half = nn.Linear(4, 4)
    half.weight = nn.Parameter(half.weight.detach().as_subclass(_OnlyPreAllGather))
    half_extension = _error(lambda: hp.fully_shard(half))
    return [zero_dim, bad_dim, mesh_3d, half_extension]


class _OnlyPreAllGather(torch.Tensor):
    """Half an all-gather extension (no fsdp_post_all_gather)."""

    def fsdp_pre_all_gather(self, mesh):
        return (self,), None


def test_errors_name_the_parameter_and_the_mesh():
    for zero_dim, bad_dim, mesh_3d, half_extension in run_on_ranks(2, _errors, timeout=120):
        assert "'scalar_p'" in zero_dim and "Change scalar_p to a 1D tensor with numel equal to 1" in zero_dim
        assert bad_dim.startswith("parameter '0.bias': shard dim 1 is out of range"), bad_dim
        assert mesh_3d.startswith("fully_shard expects a 1D or 2D DeviceMesh but got DeviceMesh"), mesh_3d
        assert half_extension == ("parameter 'weight': _OnlyPreAllGather defines only one of fsdp_pre_all_gather "
                                  "/ fsdp_post_all_gather: an all-gather extension needs both"), half_extension
