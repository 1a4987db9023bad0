"""get/set model and optimizer state dicts on DTensor models, sharded and full, across layouts."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyper_parallel.core.distributed_checkpoint.optimizer_state_dict import (
    OptimizerState,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from hyper_parallel.core.distributed_checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from tests.checkpoint.helpers import full_model_state_dict, make_llama, seeded_grads_step, shard_params
from tests.multirank import run_on_ranks

FULL = StateDictOptions(full_state_dict=True)


# ---------------------------------------------------------------------------- ranks


def _model_state_dict_forms():
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    reference = make_llama()
    model = shard_params(make_llama(), mesh, lambda n, p: [Shard(0)])

    sharded = get_model_state_dict(model)
    assert sharded.keys() == reference.state_dict().keys()
    assert all(isinstance(v, DTensor) for v in sharded.values())
    # Sharded values share storage with the parameters.
    assert sharded["norm.weight"].to_local().data_ptr() == model.norm.weight.to_local().data_ptr()

    full = get_model_state_dict(model, options=FULL)
    for key, value in reference.state_dict().items():
        assert not isinstance(full[key], DTensor)
        assert torch.equal(full[key], value), key

    offloaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        assert all(v.device.type == "cpu" and torch.equal(v, reference.state_dict()[k])
                   for k, v in offloaded.items())
        assert offloaded.keys() == reference.state_dict().keys()
    else:
        assert offloaded == {}
    return True


def _model_set_full_and_sharded_into_other_layout():
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    source = shard_params(make_llama(seed=1), mesh, lambda n, p: [Shard(0)])
    expected = full_model_state_dict(source)

    # Full values into a Shard(1) model.
    target = shard_params(make_llama(seed=2), mesh, lambda n, p: [Shard(p.dim() - 1)])
    set_model_state_dict(target, get_model_state_dict(source, options=FULL))
    assert all(torch.equal(v, expected[k]) for k, v in full_model_state_dict(target).items())

    # Sharded values (same mesh, other placements) are redistributed.
    target = shard_params(make_llama(seed=2), mesh, lambda n, p: [Shard(p.dim() - 1)])
    set_model_state_dict(target, get_model_state_dict(source))
    assert all(torch.equal(v, expected[k]) for k, v in full_model_state_dict(target).items())

    # Full values into a 2-D (replicate, shard) layout.
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    target = shard_params(make_llama(seed=2), mesh2, lambda n, p: [Replicate(), Shard(0)])
    set_model_state_dict(target, get_model_state_dict(source, options=FULL))
    assert all(torch.equal(v, expected[k]) for k, v in full_model_state_dict(target).items())
    return True


def _strict_errors():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = shard_params(make_llama(), mesh, lambda n, p: [Shard(0)])
    sd = get_model_state_dict(model, options=FULL)
    sd["bogus.weight"] = torch.zeros(1)
    norm = sd.pop("norm.weight")
    with pytest.raises(KeyError, match=r"norm\.weight.*bogus\.weight"):
        set_model_state_dict(model, sd)
    result = set_model_state_dict(model, sd, options=StateDictOptions(strict=False))
    assert result.missing_keys == ["norm.weight"] and result.unexpected_keys == ["bogus.weight"]
    sd.pop("bogus.weight")
    sd["norm.weight"] = torch.cat([norm, norm])
    with pytest.raises(ValueError, match=r"norm\.weight: shape mismatch"):
        set_model_state_dict(model, sd)

    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    osd = get_optimizer_state_dict(model, optim)
    del osd["state"]["output.weight"]
    with pytest.raises(KeyError, match=r"state\.output\.weight"):
        set_optimizer_state_dict(model, optim, osd)
    return True


def _optimizer_round_trip(full: bool):
    """Optimizer state of a Shard(0) model loads into a differently sharded model + optimizer."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = shard_params(make_llama(seed=3, tie_embeddings=True), mesh, lambda n, p: [Shard(0)])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.9), weight_decay=0.1)
    for step in range(2):
        seeded_grads_step(model, optim, step)
    options = FULL if full else None
    model_sd = get_model_state_dict(model, options=options)
    optim_sd = get_optimizer_state_dict(model, optim, options=options)
    # Tied parameters appear once, under their first name; ids are replaced by FQNs.
    assert "output.weight" not in optim_sd["state"] and "tok_embeddings.weight" in optim_sd["state"]
    assert optim_sd["param_groups"][0]["params"][0] == "tok_embeddings.weight"

    if full:
        mesh2 = init_device_mesh("cpu", (2, world // 2))
        placements = lambda n, p: [Replicate(), Shard(p.dim() - 1)]  # noqa: E731
    else:
        mesh2, placements = mesh, (lambda n, p: [Shard(p.dim() - 1)])
    model2 = shard_params(make_llama(seed=4, tie_embeddings=True), mesh2, placements)
    optim2 = torch.optim.AdamW(model2.parameters(), lr=0.5)  # no step taken yet
    set_model_state_dict(model2, model_sd)
    set_optimizer_state_dict(model2, optim2, optim_sd)
    assert optim2.param_groups[0]["betas"] == (0.8, 0.9) and optim2.param_groups[0]["lr"] == 1e-2
    assert isinstance(next(iter(optim2.state.values()))["exp_avg"], DTensor)

    got = get_optimizer_state_dict(model2, optim2, options=FULL)
    want = get_optimizer_state_dict(model, optim, options=FULL)
    assert got["state"].keys() == want["state"].keys()
    for fqn, state in want["state"].items():
        for name, value in state.items():
            assert torch.equal(got["state"][fqn][name], value), (fqn, name)

    # Both continue identically.
    seeded_grads_step(model, optim, 7)
    seeded_grads_step(model2, optim2, 7)
    reference, resumed = full_model_state_dict(model), full_model_state_dict(model2)
    return all(torch.equal(resumed[k], v) for k, v in reference.items())


def _fresh_optimizer_state_is_a_no_op():
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model_a = shard_params(make_llama(seed=5), mesh, lambda n, p: [Shard(0)])
    model_b = shard_params(make_llama(seed=5), mesh, lambda n, p: [Shard(0)])
    optim_a = torch.optim.AdamW(model_a.parameters(), lr=1e-2)
    optim_b = torch.optim.AdamW(model_b.parameters(), lr=1e-2)
    before = full_model_state_dict(model_a)
    sd = OptimizerState(model_a, optim_a).state_dict()  # initialises lazily
    assert all(torch.equal(v, before[k]) for k, v in full_model_state_dict(model_a).items())
    assert all(float(s["step"]) == 0 and s["exp_avg"].to_local().abs().sum() == 0 for s in sd["state"].values())
    seeded_grads_step(model_a, optim_a, 0)
    seeded_grads_step(model_b, optim_b, 0)
    a, b = full_model_state_dict(model_a), full_model_state_dict(model_b)
    return all(torch.equal(v, b[k]) for k, v in a.items())


def _fully_shard_state_dict(impl):
    """State dicts of torch's fully_shard and hp.fully_shard (uneven Shard(1)) models."""
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
        kwargs = {}
    else:
        from hyper_parallel import fully_shard
        kwargs = {"shard_placement_fn": lambda p: Shard(p.dim() - 1)}

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = make_llama(seed=7, vocab_size=255)  # 255: uneven shards
    reference = make_llama(seed=6, vocab_size=255)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    osd = get_optimizer_state_dict(model, optim)
    assert osd["state"].keys() == dict(reference.named_parameters()).keys()
    assert get_model_state_dict(model).keys() == reference.state_dict().keys()
    set_model_state_dict(model, reference.state_dict())  # full values into the sharded params
    full = get_model_state_dict(model, options=FULL)
    assert all(torch.equal(full[k], v) for k, v in reference.state_dict().items())
    tokens = torch.randint(0, 255, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the forward uses the loaded values
        return torch.allclose(model(tokens), reference(tokens), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world", [2, 4])
def test_model_state_dict_sharded_full_and_offloaded(world):
    assert all(run_on_ranks(world, _model_state_dict_forms, timeout=120))


def test_set_model_state_dict_into_other_layouts():
    assert all(run_on_ranks(4, _model_set_full_and_sharded_into_other_layout, timeout=120))


def test_strict_errors_name_keys():
    assert all(run_on_ranks(2, _strict_errors, timeout=120))


@pytest.mark.parametrize("full", [False, True], ids=["sharded", "full"])
def test_optimizer_state_round_trip_into_other_sharding(full):
    assert all(run_on_ranks(4, _optimizer_round_trip, full, timeout=120))


def test_fresh_optimizer_state_dict_does_not_change_training():
    assert all(run_on_ranks(2, _fresh_optimizer_state_is_a_no_op, timeout=120))


@pytest.mark.parametrize("impl", ["torch", "hyper_parallel"])
def test_fully_shard_models(impl):
    assert all(run_on_ranks(2, _fully_shard_state_dict, impl, timeout=120))


def test_model_parts_merge_disjoint_names_and_refuse_shared_ones():
    """A sequence of model parts (a rank's pipeline stages) is one state dict; the optimizer
    state of the parts is keyed by the same names."""
    from hyper_parallel.models.llama_parallel import split_stage

    model = make_llama(seed=3, n_layers=3)
    parts = [split_stage(model, range(0, 1), first=True, last=False),
             split_stage(model, range(2, 3), first=False, last=True)]
    merged = get_model_state_dict(parts)
    assert list(merged) == [k for k in model.state_dict() if not k.startswith("layers.1.")]
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in merged.items())
    optim = torch.optim.AdamW([p for part in parts for p in part.parameters()])
    assert list(get_optimizer_state_dict(parts, optim)["state"]) == list(merged)
    with pytest.raises(ValueError, match="model parts must have disjoint names, 'layers.0.attention.wk.weight'"):
        get_model_state_dict([parts[0], split_stage(model, range(0, 2), first=False, last=False)])
