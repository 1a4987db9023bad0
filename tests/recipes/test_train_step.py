"""The training step on a plain (unsharded) model in one process: accumulation and learning."""

import copy

import torch

from hyper_parallel.data import DistributedBatchLoader, MarkovSource
from hyper_parallel.trainer import compose_config, train_step
from hyper_parallel.trainer.setup.optimizer import build_optimizer
from hyper_parallel.trainer.setup.parallelize import build_model


def _setup(overrides=(), dtype=torch.float32):
    cfg = compose_config(["model.dim=32", "model.n_layers=1", *overrides])
    model = build_model(cfg.model, mesh=None, device=torch.device("cpu"), seed=0).to(dtype)
    return cfg, model, build_optimizer(model, cfg.optim)


def test_gradient_accumulation_matches_one_big_batch():
    """In float64: accumulation only reorders sums, so any CPU agrees to ~1e-15 relative."""
    cfg, model, optim = _setup(dtype=torch.float64)
    model2 = copy.deepcopy(model)
    optim2 = build_optimizer(model2, cfg.optim)
    batch = MarkovSource(256, 16, seed=0).samples(range(8))
    for _ in range(2):
        one = train_step(model, batch, optim, grad_accum_steps=1, max_grad_norm=0.5)
        four = train_step(model2, batch, optim2, grad_accum_steps=4, max_grad_norm=0.5)
        assert one["loss"].dtype == torch.float64
        torch.testing.assert_close(one["loss"], four["loss"], rtol=1e-12, atol=0)
        torch.testing.assert_close(one["grad_norm"], four["grad_norm"], rtol=1e-12, atol=0)
    for p, q in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def _count_block_forwards(model):
    """Calls of each block's attention (inside the block's forward, so recomputation counts too)."""
    calls = []
    for layer in model.layers.values():
        layer.attention.register_forward_hook(lambda *_: calls.append(layer))
    return calls


def test_activation_checkpointing_recomputes_each_block_in_backward():
    batch = MarkovSource(256, 16, seed=0).samples(range(4))
    results, forwards = [], []
    for ac in ("false", "true"):
        _, model, optim = _setup([f"model.activation_checkpointing={ac}", "model.n_layers=2"])
        calls = _count_block_forwards(model)
        results.append([float(train_step(model, batch, optim, grad_accum_steps=1, max_grad_norm=1.0)["loss"])
                        for _ in range(2)])
        forwards.append(len(calls))
        assert "_checkpoint_wrapped_module" not in "".join(model.state_dict())
    assert forwards == [2 * 2, 2 * 2 * 2]  # 2 steps x 2 blocks, and once more in each backward
    assert results[0] == results[1]


def test_loss_falls_towards_the_markov_floor():
    torch.manual_seed(0)
    cfg, model, optim = _setup(["optim.lr=1e-2"])
    source = MarkovSource(256, 32, seed=1234, branching=4)
    loader = DistributedBatchLoader(source, 16)
    losses = [float(train_step(model, loader.next_batch(), optim, grad_accum_steps=1, max_grad_norm=1.0)["loss"])
              for _ in range(40)]
    assert losses[-1] < losses[0] - 1.5
    assert losses[-1] > source.loss_floor() - 0.05
