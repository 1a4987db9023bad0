"""fully_shard API on 2 gloo ranks: meta init, state_dict round trips, unshard/reshard,
prefetch, and clear errors for bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import hyper_parallel as hp
from hyper_parallel.core.fully_shard.step_phase import ShardState
from tests.fully_shard._helpers import (DTYPE, TOL, full_params, global_batch, lm_loss, max_diff, shard_layers_and_root,
                                        tiny_llama, train)
from tests.multirank import run_on_ranks


def _meta_init_and_state_dict():
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        model = shard_layers_and_root(tiny_llama(vocab_size=33, tie_embeddings=True))
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in params.values())
    local = sum(p.to_local().numel() for p in params.values())
    assert local <= total // world + 64, (local, total)  # each rank holds only its shard
    for name, param in params.items():
        assert not param.to_local().is_meta and torch.isfinite(param.to_local()).all(), name
    assert torch.equal(model.norm.weight.full_tensor(), torch.ones(16, dtype=DTYPE))
    assert model.output.weight is model.tok_embeddings.weight

    # Train it against a plain model holding the same full values.
    reference = tiny_llama(vocab_size=33, tie_embeddings=True)
    reference.load_state_dict(full_params(model))
    batches = [global_batch(s) for s in range(2)]
    train(reference, batches)
    train(model, [b.chunk(world)[rank] for b in batches])
    results = {"meta_init": max_diff(full_params(model), full_params(reference))}

    # Re-materialised after its first forward (new local tensors): all-gathers use the new data.
    saved = full_params(model)
    model.to_empty(device="cpu")
    model.init_weights(seed=5)  # also rebuilds the (non-persistent) RoPE tables
    model.load_state_dict(saved)
    train(reference, [global_batch(2)])
    train(model, [global_batch(2).chunk(world)[rank]])
    results["rematerialised"] = max_diff(full_params(model), full_params(reference))

    # state_dict holds the sharded DTensors; both full and sharded values load back.
    state = model.state_dict()
    assert all(isinstance(v, DTensor) and v.placements == (Shard(0),) for v in state.values())
    torch.manual_seed(1)
    fresh = shard_layers_and_root(tiny_llama(vocab_size=33, tie_embeddings=True))
    fresh.load_state_dict({k: v.full_tensor() for k, v in state.items()})
    results["load_full"] = max_diff(full_params(fresh), full_params(model))
    torch.manual_seed(2)
    fresh = shard_layers_and_root(tiny_llama(vocab_size=33, tie_embeddings=True))
    fresh.load_state_dict(state)
    results["load_sharded"] = max_diff(full_params(fresh), full_params(model))
    # A loaded model trains like the original (the loaded shards feed the all-gathers).
    train(fresh, [global_batch(5).chunk(world)[rank]])
    train(model, [global_batch(5).chunk(world)[rank]])
    results["train_after_load"] = max_diff(full_params(fresh), full_params(model))

    def tied_across_groups(seed):
        torch.manual_seed(seed)
        tied = tiny_llama(vocab_size=33, tie_embeddings=True)
        hp.fully_shard(tied.tok_embeddings)
        hp.fully_shard(tied.output)
        return shard_layers_and_root(tied)
    source = full_params(tied_across_groups(3))
    target = tied_across_groups(4)
    target.load_state_dict(source)
    results["load_full_tied_across_groups"] = max_diff(full_params(target), source)
    return results


def test_meta_init_and_state_dict_round_trips():
    for result in run_on_ranks(2, _meta_init_and_state_dict, timeout=180):
        bad = {k: v for k, v in result.items() if not v <= TOL}
        assert not bad, bad


def _unshard_reshard_and_prefetch():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = shard_layers_and_root(tiny_llama())
    layer0, layer1 = model.layers.values()
    reference_wq = layer0.attention.wq.weight.full_tensor()
    handle = layer0.unshard(async_op=True)
    handle.wait()
    weight = layer0.attention.wq.weight
    assert not isinstance(weight, DTensor) and torch.equal(weight, reference_wq)
    unsharded_storage = layer0._state.group.buckets[0].unsharded_flat.untyped_storage()
    assert unsharded_storage.nbytes() > 0
    layer0.reshard()
    assert isinstance(layer0.attention.wq.weight, DTensor)
    assert unsharded_storage.nbytes() == 0  # the unsharded memory is really freed
    assert torch.equal(layer0.attention.wq.weight.full_tensor(), reference_wq)

    seen, after_backward = [], []

    def record(states_of, into=seen):
        def hook(*_):
            into.append(tuple(m._state.group.state for m in states_of))
        return hook

    # Forward: when layer 0 computes, layer 1's all-gather has already been issued.
    layer0.attention.register_forward_hook(record([layer1]))
    # Backward: when layer 1's backward computes, layer 0's all-gather has been issued.
    layer1.attention.register_full_backward_hook(record([layer0]))
    # Layer 1 is resharded as soon as its backward is over (before layer 0's backward).
    layer0.attention.register_full_backward_hook(record([layer1], after_backward))
    tokens = global_batch(0).chunk(world)[rank]
    lm_loss(model, tokens).backward()   # step 1: no order known yet for implicit forward prefetch
    first = list(seen)
    seen.clear()
    lm_loss(model, tokens).backward()   # step 2: implicit forward prefetch from step 1's order
    implicit = list(seen)
    seen.clear()
    layer0.set_modules_to_forward_prefetch([])
    layer1.set_modules_to_backward_prefetch([])
    lm_loss(model, tokens).backward()
    disabled = list(seen)
    seen.clear()
    model.set_modules_to_forward_prefetch([layer0, layer1])
    lm_loss(model, tokens).backward()
    explicit = list(seen)
    return first, implicit, disabled, explicit, after_backward


def test_unshard_reshard_and_prefetch():
    sharded, unsharding, unsharded = ShardState.SHARDED, ShardState.UNSHARDING, ShardState.UNSHARDED
    for first, implicit, disabled, explicit, after_backward in run_on_ranks(
            2, _unshard_reshard_and_prefetch, timeout=120):
        assert after_backward == [(sharded,)] * 4, after_backward
        issued = (unsharding, unsharded)
        assert first[0] == (sharded,) and first[1][0] in issued, first
        assert implicit[0][0] in issued and implicit[1][0] in issued, implicit
        assert disabled == [(sharded,), (sharded,)], disabled
        assert explicit[0][0] in issued and explicit[1] == (sharded,), explicit


def _misuse_errors():
    messages = {}

    def expect(key, exc, fn):
        with pytest.raises(exc) as info:
            fn()
        messages[key] = str(info.value)

    model = hp.fully_shard(nn.Linear(4, 4))
    expect("twice", ValueError, lambda: hp.fully_shard(model))
    mesh3d = hp.init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("a", "b", "c"))
    expect("mesh_rank", ValueError, lambda: hp.fully_shard(nn.Linear(4, 4), mesh=mesh3d))
    expect("placement", ValueError,
           lambda: hp.fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: Replicate()))
    expect("reshard_int", ValueError, lambda: hp.fully_shard(nn.Linear(4, 4), reshard_after_forward=3))
    expect("prefetch", ValueError, lambda: model.set_modules_to_forward_prefetch([nn.Linear(2, 2)]))
    # A parameter on another device type than the mesh's: no second device type exists on a
    # CPU-only machine, so make every tensor report "cuda:0" while fully_shard inspects it.
    with mock.patch.object(torch.Tensor, "device", new_callable=mock.PropertyMock,
                           return_value=torch.device("cuda", 0)):
        expect("device", ValueError, lambda: hp.fully_shard(nn.Linear(4, 4)))
    return messages


def test_bad_input_errors():
    messages = run_on_ranks(2, _misuse_errors, timeout=60)[0]
    assert "already" in messages["twice"]
    assert "3-D" in messages["mesh_rank"]
    assert "Shard" in messages["placement"]
    assert "reshard_after_forward" in messages["reshard_int"]
    assert "fully_shard modules" in messages["prefetch"]
    assert "cuda" in messages["device"] and "weight" in messages["device"]


def test_no_process_group_is_a_clear_error():
    # A fresh interpreter: this pytest process may hold a process group from other tests.
    code = "import torch.nn as nn, hyper_parallel as hp; hp.fully_shard(nn.Linear(2, 2))"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0
    assert "RuntimeError" in proc.stderr and "process group" in proc.stderr, proc.stderr[-2000:]
