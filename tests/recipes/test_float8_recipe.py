"""``training.float8``: the recipe's model with torchao float8 linears, sharded by fully_shard."""

import pytest
import torch
import torch.distributed as dist

from hyper_parallel._torch_compat import local_tensor
from hyper_parallel.core.fully_shard import collectives
from hyper_parallel.data import DistributedBatchLoader, MarkovSource
from hyper_parallel.trainer import compose_config, train_step, typed_config, validate_config
from hyper_parallel.trainer.launch import preflight
from hyper_parallel.trainer.setup.optimizer import build_optimizer
from hyper_parallel.trainer.setup.parallelize import build_mesh, build_model
from tests.multirank import run_on_ranks

OVERRIDES = ["model.dim=32", "model.n_layers=2", "model.ffn_hidden_dim=64", "model.activation_checkpointing=true",
             "optim.warmup_steps=0", "training.float8=true"]


def test_missing_torchao_is_one_clear_line(monkeypatch):
    monkeypatch.setattr(preflight, "available", lambda package: package != "torchao")
    assert preflight.package_problems(typed_config(compose_config(OVERRIDES))) == [
        "training.float8=true needs the 'torchao' package: pip install 'hyper_parallel[float8]', "
        "or set training.float8=false"]
    assert preflight.package_problems(typed_config(compose_config(OVERRIDES[:-1]))) == []


def _train_steps(model, cfg, steps: int, *, float8_scales: bool):
    """``steps`` recipe steps of ``model`` on this rank's batches: the losses and the dtypes of
    every collective's payload."""
    opt = build_optimizer(model, cfg.optim)
    loader = DistributedBatchLoader(MarkovSource(256, 16, seed=1), 8, dp_rank=dist.get_rank(),
                                    dp_size=dist.get_world_size())
    losses, gathered = [], set()
    for _ in range(steps):
        collectives.reset_collective_counts()
        result = train_step(model, loader.next_batch(), opt, grad_accum_steps=1, max_grad_norm=1.0,
                            float8_scales=float8_scales)
        gathered |= {str(dtype) for _, dtype in collectives.collective_bytes()}
        losses.append(float(result["loss"]))
    return losses, sorted(gathered)


def _float8_steps(recipe):
    torch.manual_seed(0)
    cfg = compose_config(OVERRIDES + [f"training.float8_recipe={recipe}"])
    dims = validate_config(cfg, dist.get_world_size()).dims
    cpu = torch.device("cpu")
    model = build_model(cfg.model, mesh=build_mesh(dims, "cpu"), device=cpu, seed=0, float8_recipe=recipe)
    names = sorted({type(m).__name__ for m in (model.layers["0"].attention.wq, model.layers["0"].feed_forward.w1,
                                              model.output)})
    losses, gathered = _train_steps(model, cfg, 4, float8_scales=recipe == "tensorwise")
    scales = [local_tensor(m.weight)._precomputed_scale is not None for m in model.modules()
              if type(m).__name__ == "Float8Linear" and recipe == "tensorwise"]
    return names, losses, sorted(gathered), scales


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_recipe_trains(recipe):
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'hyper_parallel[float8]')")
    results = run_on_ranks(2, _float8_steps, recipe, timeout=180)
    # Each rank's loss is that of its own batch (noisy from step to step): it learns on average.
    losses = torch.tensor([result[1] for result in results])
    assert torch.isfinite(losses).all() and losses[:, -1].mean() < losses[:, 0].mean(), losses
    for names, _, gathered, scales in results:
        assert names == ["Float8Linear", "Linear"], names  # the output layer stays high precision
        # tensorwise: weights gathered as float8 bytes; scales precomputed after each step.
        assert ("torch.uint8" in gathered) == (recipe == "tensorwise"), gathered
        assert all(scales) and (len(scales) > 0) == (recipe == "tensorwise"), scales


def _moe_float8_steps(ep: int):
    torch.manual_seed(0)
    # 16 experts: the routers are 32 -> 16, a size float8 could take (they are kept out by name).
    overrides = ["model=moe_debug", "model.moe.num_experts=16", "training.float8=true", "optim.warmup_steps=0",
                 f"parallel.ep={ep}"]
    valid = validate_config(compose_config(overrides), dist.get_world_size())
    cfg, dims = valid.cfg, valid.dims
    model = build_model(cfg.model, mesh=build_mesh(dims, "cpu"), device=torch.device("cpu"), seed=0,
                        float8_recipe="tensorwise", ep=ep)
    moe = model.layers["0"].moe
    float8 = {name: type(module).__name__ == "Float8Linear" for name, module in (
        ("wq", model.layers["0"].attention.wq), ("router", moe.router.gate), ("experts", moe.experts),
        ("output", model.output))}
    losses, gathered = _train_steps(model, cfg, 3, float8_scales=True)
    return float8, losses, gathered


def test_float8_on_a_mixture_of_experts_converts_the_dense_linears_only():
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'hyper_parallel[float8]')")
    plain, ep2 = (run_on_ranks(2, _moe_float8_steps, ep, timeout=180) for ep in (1, 2))
    for float8, _, gathered in plain + ep2:
        # Attention in float8 (gathered as float8 bytes); the routers, the grouped experts and
        # the output layer in high precision.
        assert float8 == {"wq": True, "router": False, "experts": False, "output": False}, float8
        assert "torch.uint8" in gathered, gathered
    # Expert parallelism changes where the experts compute, not the float8 training.
    for (_, a, _), (_, b, _) in zip(plain, ep2):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=0), (a, b)
