"""HSDP (2x2), FSDP with empty shards, FSDP+TP (dp=2 x tp=2) and the creation of fully_shard's own
process groups, on 4 gloo ranks."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import hyper_parallel as hp
from hyper_parallel.core.fully_shard import collectives
from hyper_parallel.core.fully_shard import mesh as fully_shard_mesh
from tests.fully_shard._helpers import (DTYPE, TOL, full_params, global_batch, lm_loss, max_diff, parity,
                                        shard_layers_and_root, tiny_llama, train)
from tests.multirank import run_on_ranks


def _hsdp_mesh():
    return hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


class _Uneven(nn.Module):
    """Row counts 7 and 3 over 4 ranks: uneven shards, one of them empty."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(5, 7)
        self.down = nn.Linear(7, 3)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _mse_5_to_rest(model, batch):
    return ((model(batch[:, :5]) - batch[:, 5:]) ** 2).mean()


HSDP_VARIANTS = ["hsdp", "hsdp_partial_all_reduce", "empty_shards", "empty_shards_dim1"]


def _hsdp_variant(variant: str):
    rank = dist.get_rank()
    mesh = _hsdp_mesh()
    dp_rank = rank  # replicate-major: data-parallel index = rank
    if variant == "hsdp":
        result = parity(lambda m: shard_layers_and_root(m, mesh=mesh), dp_rank, 4)
        torch.manual_seed(0)
        model = shard_layers_and_root(tiny_llama(), mesh=mesh)
        for name, param in model.named_parameters():
            assert param.placements == (Replicate(), Shard(0)), (name, param.placements)
        collectives.reset_collective_counts()
        lm_loss(model, global_batch(0).chunk(4)[rank]).backward()
        counts = collectives.collective_counts()
        assert counts == {"all_gather": 5, "reduce_scatter": 3, "all_reduce": 3}, counts
        return {variant: result}
    if variant == "hsdp_partial_all_reduce":
        def no_all_reduce_first(model, micro, n_micro):
            model.set_requires_all_reduce(micro == n_micro - 1)
        collectives.reset_collective_counts()
        result = parity(
            lambda m: shard_layers_and_root(m, mesh=mesh), dp_rank, 4, steps=1, batch_size=8, micro_batches=2,
            before_micro=no_all_reduce_first)
        counts = collectives.collective_counts()
        assert counts["reduce_scatter"] == 6 and counts["all_reduce"] == 3, counts  # 3 groups
        return {variant: result}

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(8, 8, generator=gen, dtype=DTYPE) for _ in range(2)]
    placement_fn = {"empty_shards": None, "empty_shards_dim1": lambda p: Shard(p.ndim - 1)}[variant]
    torch.manual_seed(0)
    reference = _Uneven().to(DTYPE)
    model = hp.fully_shard(copy.deepcopy(reference), shard_placement_fn=placement_fn)
    if placement_fn is None:
        assert model.down.weight.to_local().shape[0] == (0 if rank == 3 else 1)
    train(reference, batches, loss_fn=_mse_5_to_rest)
    train(model, [b.chunk(4)[rank] for b in batches], loss_fn=_mse_5_to_rest)
    return {variant: max_diff(full_params(model), full_params(reference))}


def _reshard_to_smaller_group():
    """reshard_after_forward=2 on 4 ranks: backward all-gathers within pairs of ranks."""
    rank = dist.get_rank()
    sizes = []
    real_all_gather = collectives.all_gather

    def recording_all_gather(output, shard, group, async_op):
        sizes.append(dist.get_world_size(group))
        return real_all_gather(output, shard, group, async_op)

    def wrap(model):
        for layer in model.layers.values():
            hp.fully_shard(layer, reshard_after_forward=2)
        return hp.fully_shard(model)

    with mock.patch.object(collectives, "all_gather", recording_all_gather):
        diff = parity(wrap, rank, 4, model_fn=lambda: tiny_llama(vocab_size=33, dim=20))  # uneven wk, wv
    # Per step: forward 3 all-gathers over 4 ranks, backward 2 (the layers) over 2 ranks.
    assert sizes == [4, 4, 4, 2, 2] * 2, sizes
    return diff


def test_reshard_after_forward_to_smaller_group():
    for diff in run_on_ranks(4, _reshard_to_smaller_group, timeout=180):
        assert diff <= TOL, diff


def _groups_created_by_every_rank():
    """A layer on the world mesh with reshard_after_forward=2 and one on a mesh over 2 of the 4
    ranks, with separate reduce-scatter groups: the new groups' ranks and whether they were
    created by their members only; the gradients' difference from one process."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1)).to(DTYPE)
    model = copy.deepcopy(reference)
    pairs = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("other", "pair"))["pair"]  # {0, 1} or {2, 3}
    created = []
    new_group = dist.distributed_c10d._new_group_with_tag

    def recording(ranks=None, *args, use_local_synchronization=False, **kwargs):
        created.append((sorted(ranks), use_local_synchronization))
        return new_group(ranks, *args, use_local_synchronization=use_local_synchronization, **kwargs)

    # (with the groups an earlier test of this rank pool created forgotten)
    with mock.patch.object(dist.distributed_c10d, "_new_group_with_tag", recording), \
            mock.patch.dict(fully_shard_mesh._SUBGROUPS, clear=True):
        hp.fully_shard(model[0], reshard_after_forward=2)
        hp.fully_shard(model[2], mesh=pairs)
        hp.fully_shard(model)
        model.set_separate_reduce_scatter_group()
    # the pairs hold the two halves of the batch: every group averages the same gradients
    batch = torch.randn(4, 6, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
    model(batch.chunk(2)[rank % 2]).square().mean().backward()
    reference(batch).square().mean().backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return created, max((grads[n] - p.grad).abs().max().item() for n, p in reference.named_parameters())


def test_groups_are_created_by_every_rank_of_the_world():
    """Post-forward groups (reshard_after_forward=<int>) and separate reduce-scatter groups, also
    of a mesh covering part of the world: every rank creates every group (torch's new_group
    contract), none by its members only (a hang with an eagerly initialised NCCL world)."""
    expected = sorted([([0, 1], False), ([2, 3], False),  # reshard_after_forward=2 on 4 ranks
                       ([0, 1], False), ([2, 3], False),  # separate reduce-scatter of the pairs' meshes
                       ([0, 1, 2, 3], False)])  # ... and of the world mesh
    for created, diff in run_on_ranks(4, _groups_created_by_every_rank, timeout=120):
        assert sorted(created) == expected, created
        assert diff < TOL, diff


@pytest.mark.parametrize("variant", HSDP_VARIANTS)
def test_hsdp_and_uneven_empty_shards(variant):
    for result in run_on_ranks(4, _hsdp_variant, variant, timeout=240):
        bad = {k: v for k, v in result.items() if not v <= TOL}
        assert not bad, bad


_TP_PLAN = {
    "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


def _fsdp_tp():
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()

    def wrap(model):
        for layer in model.layers.values():
            parallelize_module(layer, mesh["tp"], _TP_PLAN)
            hp.fully_shard(layer, mesh=mesh["dp"])
        hp.fully_shard(model, mesh=mesh["dp"])
        wq, wo = model.layers["0"].attention.wq.weight, model.layers["0"].attention.wo.weight
        assert wq.device_mesh.mesh_dim_names == ("dp", "tp")
        assert wq.placements == (_StridedShard(0, split_factor=2), Shard(0)), wq.placements
        assert wo.placements == (Shard(0), Shard(1)), wo.placements
        return model

    diff = parity(wrap, dp_rank, 2, model_fn=lambda: tiny_llama(n_kv_heads=2))
    # Full (plain) tensors load into the (dp, tp)-sharded parameters: each rank takes its slice.
    torch.manual_seed(1)
    source = full_params(tiny_llama(n_kv_heads=2))
    torch.manual_seed(2)
    target = wrap(tiny_llama(n_kv_heads=2))
    target.load_state_dict(source)
    load_diff = max_diff(full_params(target), source)

    # HSDP + TP: a (replicate=1, shard=2, tp=2) mesh gives 3-D parameter placements.
    mesh3d = hp.init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    hsdp_mesh = mesh3d["replicate", "shard"]

    def wrap_hsdp(model):
        for layer in model.layers.values():
            parallelize_module(layer, mesh3d["tp"], _TP_PLAN)
            hp.fully_shard(layer, mesh=hsdp_mesh)
        hp.fully_shard(model, mesh=hsdp_mesh)
        wo = model.layers["0"].attention.wo.weight
        assert wo.placements == (Replicate(), Shard(0), Shard(1)), wo.placements
        return model

    hsdp_diff = parity(wrap_hsdp, mesh3d["shard"].get_local_rank(), 2,
                       model_fn=lambda: tiny_llama(n_kv_heads=2))
    return diff, load_diff, hsdp_diff


def test_fsdp_and_hsdp_plus_tensor_parallel():
    for diff, load_diff, hsdp_diff in run_on_ranks(4, _fsdp_tp, timeout=240):
        assert diff <= TOL and hsdp_diff <= TOL, (diff, hsdp_diff)
        assert load_diff == 0, load_diff
