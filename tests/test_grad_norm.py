"""hp.clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ on the full (unsharded) gradients."""

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import hyper_parallel as hp
from hyper_parallel.core import grad_norm
from tests.multirank import run_on_ranks

NORM_TYPES = (2.0, 1.0, math.inf)
S0, S1, R = Shard(0), Shard(1), Replicate()


def _meshes():
    world = dist.get_world_size()
    meshes = {"1d": init_device_mesh("cpu", (world,))}
    if world == 4:
        meshes["2d"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return meshes


# name -> (world, [(shape, mesh key or None for a plain tensor, placements)])
CASES = {
    "fsdp_uneven_and_plain": (2, [
        ((7, 5), "1d", (S0,)), ((4, 3), "1d", (S0,)), ((1, 6), "1d", (S0,)),
        ((9,), "1d", (S0,)), ((3, 4), None, None),
    ]),
    "shard1_uneven": (2, [((5, 7), "1d", (S1,)), ((6, 2), "1d", (S0,))]),
    "partial": (2, [((4, 6), "1d", (Partial(),)), ((7, 5), "1d", (S0,))]),
    "fsdp4_uneven_empty_shard": (4, [
        ((7, 5), "1d", (S0,)), ((3, 2), "1d", (S0,)), ((5, 7), "1d", (S1,)),
    ]),
    "hsdp": (4, [((7, 5), "2d", (R, S0)), ((6, 3), "2d", (R, S0)), ((5,), "2d", (R, S0))]),
    "fsdp_tp": (4, [((7, 5), "2d", (S0, S1)), ((8, 6), "2d", (S0, R)), ((3, 9), "2d", (R, S1))]),
    "mixed_meshes": (4, [
        ((7, 5), "1d", (S0,)), ((6, 4), "2d", (R, S0)), ((5, 6), "2d", (S0, S1)),
        ((4, 4), "tp", (S0,)), ((5, 3), "dp", (R,)), ((3,), None, None), ((5, 3), "2d", (S0, R)),
    ]),
}


def _sub_mesh(meshes, key):
    # "tp"/"dp": 1-D sub-meshes of the 2-D mesh that do not span the world.
    return meshes["2d"][key] if key in ("tp", "dp") else meshes[key]


def _distribute(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    if mesh is None:
        return full.clone()
    if any(pl.is_partial() for pl in placements):
        # Random summands: each local tensor differs from the full one, their sum is it.
        summand = torch.randn(full.shape, generator=torch.Generator().manual_seed(dist.get_rank()))
        local = full - summand * (mesh.size() - 1) if mesh.get_local_rank() == 0 else summand
        return DTensor.from_local(local, mesh, placements)
    return distribute_tensor(full, mesh, placements)


def _full_grad(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _clip_layouts(layouts, seed: int, norm_type: float, *, max_norm_scale: float = 0.5, max_norm=None):
    """Clip the same grads in ``layouts`` with hp and (on full copies) with torch; compare."""
    meshes = _meshes()
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape, key, placements in layouts:
        mesh = None if key is None else _sub_mesh(meshes, key)
        param = nn.Parameter(_distribute(torch.zeros(shape), mesh, placements) if mesh else torch.zeros(shape))
        param.grad = _distribute(torch.randn(shape, generator=gen), mesh, placements)
        params.append(param)
    reference = [nn.Parameter(torch.zeros(p.shape)) for p in params]
    for ref, param in zip(reference, params):
        ref.grad = _full_grad(param.grad).clone()
    if max_norm is None:
        max_norm = max_norm_scale * torch.nn.utils.get_total_norm([r.grad for r in reference], norm_type).item()
    expected = torch.nn.utils.clip_grad_norm_(reference, max_norm, norm_type)

    total = hp.clip_grad_norm_(params, max_norm, norm_type)

    assert type(total) is torch.Tensor and total.dim() == 0
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
    for ref, param in zip(reference, params):
        torch.testing.assert_close(_full_grad(param.grad), ref.grad, rtol=1e-5, atol=1e-7)
    return total.item()


def _run_case(name: str):
    _, layouts = CASES[name]
    return [_clip_layouts(layouts, seed=len(name), norm_type=p) for p in NORM_TYPES]


@pytest.mark.parametrize("name", sorted(CASES))
def test_total_norm_and_clipped_grads_match_single_process(name):
    world = CASES[name][0]
    per_rank = run_on_ranks(world, _run_case, name, timeout=120)
    assert all(totals == per_rank[0] for totals in per_rank), per_rank  # bitwise equal on all ranks


def _unclipped_when_below_max_norm():
    # max_norm above the norm: grads must come back unchanged (coefficient clamped to 1).
    return _clip_layouts(CASES["hsdp"][1], seed=3, norm_type=2.0, max_norm=1e6)


def test_grads_unchanged_below_max_norm():
    run_on_ranks(4, _unclipped_when_below_max_norm, timeout=60)


def _count_all_reduces_mixed_meshes():
    calls = []
    original = grad_norm.dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(kwargs.get("group"))
        return original(*args, **kwargs)

    grad_norm.dist.all_reduce = counting
    try:
        _clip_layouts(CASES["mixed_meshes"][1], seed=5, norm_type=2.0)
    finally:
        grad_norm.dist.all_reduce = original
    return len(calls)


def test_one_all_reduce_per_mesh_scope():
    # The world-spanning meshes share one all-reduce; the "tp" and "dp" sub-meshes get one each.
    assert run_on_ranks(4, _count_all_reduces_mixed_meshes, timeout=60) == [3] * 4


def _nonfinite_on_rank_one_shard(value: float, norm_type: float, error_if_nonfinite: bool):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.ones(4, 3)
    full[3, 1] = value  # row 3 lives on rank 1 only
    param = nn.Parameter(distribute_tensor(torch.zeros(4, 3), mesh, (S0,)))
    param.grad = distribute_tensor(full, mesh, (S0,))
    try:
        total = hp.clip_grad_norm_([param], 1.0, norm_type, error_if_nonfinite=error_if_nonfinite)
    except RuntimeError as err:
        return str(err)
    return total.item()


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_nan_on_one_rank_gives_nan_everywhere(norm_type):
    results = run_on_ranks(2, _nonfinite_on_rank_one_shard, math.nan, norm_type, False, timeout=60)
    assert all(math.isnan(r) for r in results), results


def test_nonfinite_norm_raises_on_every_rank_when_asked():
    results = run_on_ranks(2, _nonfinite_on_rank_one_shard, math.inf, 2.0, True, timeout=60)
    assert all("non-finite" in r for r in results), results


def test_plain_tensors_without_process_group_match_torch():
    gen = torch.Generator().manual_seed(0)
    ours = [nn.Parameter(torch.zeros(s)) for s in ((3, 4), (5,))]
    ref = [nn.Parameter(torch.zeros(s)) for s in ((3, 4), (5,))]
    for a, b in zip(ours, ref):
        a.grad = torch.randn(a.shape, generator=gen)
        b.grad = a.grad.clone()
    for norm_type in NORM_TYPES:
        torch.testing.assert_close(
            hp.clip_grad_norm_(ours, 0.7, norm_type, foreach=False),
            torch.nn.utils.clip_grad_norm_(ref, 0.7, norm_type, foreach=False),
        )
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("norm_type", [0.0, -1.0])
def test_bad_norm_type_is_rejected(norm_type):
    param = nn.Parameter(torch.zeros(2))
    param.grad = torch.ones(2)
    with pytest.raises(ValueError, match="norm_type"):
        hp.clip_grad_norm_([param], 1.0, norm_type)


def test_no_grads_gives_zero():
    assert hp.clip_grad_norm_([nn.Parameter(torch.zeros(2))], 1.0).item() == 0.0


def _uneven_mlp() -> nn.Module:
    torch.manual_seed(0)  # odd sizes: shards are uneven on 2 and 4 ranks
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 9))


def _fully_shard_backward_then_clip(hsdp: bool, norm_type: float):
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(7)
    inputs, targets = torch.randn(4 * world, 5, generator=gen), torch.randn(4 * world, 9, generator=gen)

    reference = _uneven_mlp()
    nn.functional.mse_loss(reference(inputs), targets).backward()
    max_norm = 0.5 * torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()], norm_type).item()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)

    mesh = init_device_mesh("cpu", (2, world // 2)) if hsdp else init_device_mesh("cpu", (world,))
    model = _uneven_mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            hp.fully_shard(layer, mesh=mesh)
    hp.fully_shard(model, mesh=mesh)
    rows = slice(4 * rank, 4 * (rank + 1))
    nn.functional.mse_loss(model(inputs[rows]), targets[rows]).backward()
    total = hp.clip_grad_norm_(model.parameters(), max_norm, norm_type)

    torch.testing.assert_close(total, expected, rtol=1e-5, atol=0)
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad.full_tensor(), ref.grad, rtol=1e-5, atol=1e-6)
    return total.item()


def _fully_shard_clip_all_norm_types(hsdp: bool):
    return [_fully_shard_backward_then_clip(hsdp, p) for p in NORM_TYPES]


@pytest.mark.parametrize("world,hsdp", [(2, False), (4, True)])
def test_fully_shard_grads_clip_like_single_process_on_global_batch(world, hsdp):
    per_rank = run_on_ranks(world, _fully_shard_clip_all_norm_types, hsdp, timeout=120)
    assert all(totals == per_rank[0] for totals in per_rank), per_rank


def _pipeline_stages_clip(norm_type: float):
    """4 ranks as pp=2 x dp=2: stage 0 holds a float32 and a float64 gradient sharded over its
    dp pair, stage 1 a float32 one, or none at all (a stage without gradients)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(7, 5, generator=gen), torch.randn(6, generator=gen, dtype=torch.float64),
            torch.randn(3, 4, generator=gen)]
    mine = full[:2] if pp_rank == 0 else full[2:] if norm_type != 1.0 else []
    everyone = full if norm_type != 1.0 else full[:2]
    params = []
    for value in mine:
        param = nn.Parameter(distribute_tensor(torch.zeros_like(value), mesh["dp"], [S0]))
        param.grad = distribute_tensor(value.clone(), mesh["dp"], [S0])
        params.append(param)
    norm = hp.clip_grad_norm_(params, 0.1, norm_type, pp_group=mesh["pp"].get_group())
    expected = torch.nn.utils.get_total_norm([t.double() for t in everyone], norm_type)
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    assert norm.dtype == torch.float64  # one stage's float64 gradient makes it float64 everywhere
    coef = 0.1 / (expected + 1e-6)
    for param, value in zip(params, mine):
        torch.testing.assert_close(param.grad.full_tensor(), value * coef.to(value.dtype), rtol=1e-6, atol=1e-7)


def test_pipeline_stages_norm_sums_over_the_pp_group():
    for norm_type in NORM_TYPES:
        run_on_ranks(4, _pipeline_stages_clip, norm_type, timeout=120)
