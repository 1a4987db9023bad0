"""Expert parallelism composed with HSDP and with activation checkpointing, in float64 on 4 gloo
ranks, built with the recipe's own functions (``shard_experts``, ``shard_model``,
``apply_activation_checkpointing``):

- HSDP 2 x 2 with ep 2 (experts HSDP over ``(replicate, efsdp)``, dense weights over
  ``(replicate, shard)``): losses, every gradient and every parameter after a few AdamW steps
  match one process training on the global batch (the 4 ranks' batches as micro-batches, each
  balancing its own tokens as a rank does).
- EP2 x FSDP2 with activation checkpointing (the all-to-alls recomputed in backward) matches the
  same layout without it, and one process.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyper_parallel.models.moe import MoETransformer
from hyper_parallel.parallel.expert import expert_meshes
from hyper_parallel.trainer.config.parallel import ParallelDims
from hyper_parallel.trainer.setup.parallelize import (
    apply_activation_checkpointing, build_mesh, dp_mesh, shard_experts, shard_model)
from tests.checkpoint.test_moe_checkpoint import WORLD, _loss, _tokens, meta_moe_float64
from tests.multirank import run_on_ranks

STEPS = 3
TOL = 1e-10  # float64: the layouts sum the same products, at most in another order
# layout -> (replicate, shard, ep)
LAYOUTS = {"hsdp_ep2": (2, 2, 2), "fsdp_ep2": (1, 4, 2)}


def build(layout: str, checkpointing: bool) -> MoETransformer:
    """moe_debug (aux loss on) in float64: sharded as ``layout`` by the recipe's functions, or
    ``"single"`` (one process)."""
    model = meta_moe_float64()
    if checkpointing:
        apply_activation_checkpointing(model)
    if layout != "single":
        replicate, shard, ep = LAYOUTS[layout]
        mesh = dp_mesh(build_mesh(ParallelDims(replicate, shard), "cpu"))
        shard_experts(model, mesh, ep, mixed_precision="fp32", reshard_after_forward=True)
        shard_model(model, mesh, mixed_precision="fp32", reshard_after_forward=True)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def _full(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in tensors.items()}


def train(layout: str, checkpointing: bool = False) -> Tuple[List[float], Dict[str, torch.Tensor],
                                                           Dict[str, torch.Tensor], List[str], int]:
    """``STEPS`` AdamW steps on the global batch (one process: the ranks' batches as
    micro-batches): the losses (mean over the ranks), the full gradients of the last step and
    the full parameters after it, the experts' mesh and placements, and how many all-to-alls
    the steps issued."""
    model = build(layout, checkpointing)
    real, calls = dist.all_to_all_single, []

    def counting(*args, **kwargs):
        calls.append(None)
        return real(*args, **kwargs)

    dist.all_to_all_single = counting
    try:
        losses, grads, params = _steps(model, layout)
    finally:
        dist.all_to_all_single = real
    w1 = model.layers["0"].moe.experts.w1
    placements = [f"{w1.device_mesh.mesh_dim_names}"] + [str(p) for p in w1.placements] if layout != "single" else []
    return losses, grads, params, placements, len(calls)


def _steps(model: MoETransformer, layout: str) -> Tuple[List[float], Dict[str, torch.Tensor],
                                                      Dict[str, torch.Tensor]]:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ranks = [dist.get_rank()] if layout != "single" else list(range(WORLD))
    model.set_aux_loss_scale(1 / len(ranks))  # each loss is divided by it before backward
    losses, grads = [], {}
    for step in range(1, STEPS + 1):
        total = torch.zeros((), dtype=torch.float64)
        for rank in ranks:
            loss = _loss(model, _tokens(rank, step)) / len(ranks)
            loss.backward()
            total += loss.detach()
        if layout != "single":
            dist.all_reduce(total)
            total /= WORLD
        losses.append(total.item())
        grads = _full({name: p.grad for name, p in model.named_parameters()})
        optim.step()
        optim.zero_grad()
    return losses, grads, _full(dict(model.named_parameters()))


def assert_same_training(actual, expected, what: str) -> None:
    (losses, grads, params, *_), (ref_losses, ref_grads, ref_params, *_) = actual, expected
    assert len(losses) == len(ref_losses) == STEPS, (losses, ref_losses)
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= TOL * abs(b), (what, losses, ref_losses)
    assert grads.keys() == ref_grads.keys() == params.keys() == ref_params.keys(), what
    for name, grad in ref_grads.items():
        assert grad.abs().max() > 0, name
        assert (grads[name] - grad).abs().max() <= TOL, (what, "grad", name, (grads[name] - grad).abs().max())
        assert (params[name] - ref_params[name]).abs().max() <= TOL, (what, "param", name)


@pytest.fixture(scope="module")
def single():
    return train("single")


def test_ep_with_hsdp_matches_one_process(single):
    results = run_on_ranks(WORLD, train, "hsdp_ep2", timeout=180)
    # experts: replicated over the 2 replicas, ep 2 over each replica's 2 shard ranks (efsdp 1)
    assert results[0][3] == ["('replicate', 'efsdp', 'ep')", "R", "_S(0, 2)", "S(0)"], results[0][3]
    for rank, result in enumerate(results):
        assert_same_training(result, single, f"hsdp_ep2 rank {rank}")


def test_ep_with_activation_checkpointing_matches_without(single):
    for checkpointed, plain in zip(run_on_ranks(WORLD, train, "fsdp_ep2", True, timeout=180),
                                   run_on_ranks(WORLD, train, "fsdp_ep2", False, timeout=180)):
        assert checkpointed[3] == ["('efsdp', 'ep')", "_S(0, 2)", "S(0)"], checkpointed[3]
        # per MoE block and step: forward counts, tokens, combine; backward the two reverses;
        # checkpointed, the forward's three again in backward
        assert (plain[4], checkpointed[4]) == (STEPS * 2 * 5, STEPS * 2 * 8), (plain[4], checkpointed[4])
        assert_same_training(checkpointed, plain, "fsdp_ep2 checkpointed vs not")
        assert_same_training(checkpointed, single, "fsdp_ep2 checkpointed vs one process")


def _hsdp_meshes(ep: int) -> Tuple[list, list, List[str]]:
    mesh = dp_mesh(build_mesh(ParallelDims(2, WORLD // 2), "cpu"))
    ep_mesh, efsdp_mesh = expert_meshes(mesh, ep)
    return ep_mesh.mesh.tolist(), efsdp_mesh.mesh.tolist(), list(efsdp_mesh.mesh_dim_names)


def test_expert_meshes_of_an_hsdp_mesh():
    # (replicate, shard) = [[0, 1], [2, 3]]: an ep group is one replica's shard ranks; the
    # experts' HSDP mesh pairs each rank with its peer in the other replica
    assert run_on_ranks(WORLD, _hsdp_meshes, 2, timeout=60) == [
        ([0, 1], [[0], [2]], ["replicate", "efsdp"]), ([0, 1], [[1], [3]], ["replicate", "efsdp"]),
        ([2, 3], [[0], [2]], ["replicate", "efsdp"]), ([2, 3], [[1], [3]], ["replicate", "efsdp"])]
    assert [r[:2] for r in run_on_ranks(WORLD, _hsdp_meshes, 1, timeout=60)] == [
        ([0], [[0, 1], [2, 3]]), ([1], [[0, 1], [2, 3]]), ([2], [[0, 1], [2, 3]]), ([3], [[0, 1], [2, 3]])]
