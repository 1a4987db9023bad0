"""The MoE layer at accelerator speed, checked on CPU: the experts as grouped GEMM against the
split fallback and a per-expert loop, device-to-host syncs counted (none without expert
parallelism, one with it), the routing saved under activation checkpointing, and zero tokens
(alone, and under expert parallelism while the other rank has tokens)."""

from __future__ import annotations

import copy
from typing import Dict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from hyper_parallel.models.moe import build_moe
from hyper_parallel.models.moe_layer import ExpertMatmul, MoE, expert_matmul
from hyper_parallel.parallel.expert import ExpertParallel
from hyper_parallel.trainer.setup.parallelize import apply_activation_checkpointing
from hyper_parallel.utils.host_reads import counted_host_reads
from tests.multirank import run_on_ranks

DIM, HIDDEN, EXPERTS, TOP_K = 16, 24, 8, 2


def _layer(dtype: torch.dtype, **kw) -> MoE:
    moe = MoE(DIM, HIDDEN, EXPERTS, TOP_K, norm_topk_prob=True, **kw)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return moe.to(dtype)


def _tokens(n: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- grouped GEMM ------------------------------------------------------------------------------


def _experts_step(experts, x, counts, cotangent):
    x = x.clone().requires_grad_(True)
    out = experts(x, counts)
    grads = torch.autograd.grad((out * cotangent).sum(), [x, experts.w1, experts.w2, experts.w3])
    return [out, *grads]


def test_grouped_gemm_matches_the_split_fallback_and_a_per_expert_loop():
    experts = _layer(torch.float32).experts
    counts = torch.tensor([3, 0, 5, 1, 0, 7, 2, 2])  # empty experts, uneven groups (no padding)
    x, cotangent = _tokens(20, torch.float32), _tokens(20, torch.float32, seed=2)
    assert expert_matmul(x, experts.w1, experts.w2, experts.w3) is ExpertMatmul.GROUPED_MM
    grouped = _experts_step(experts, x, counts, cotangent)
    experts.matmul = ExpertMatmul.SPLIT
    split = _experts_step(experts, x, counts, cotangent)
    loop = copy.deepcopy(experts).double()  # per expert, indexing the weights, in float64
    ends = counts.cumsum(0).tolist()
    w1, w2, w3 = loop.w1, loop.w2, loop.w3
    xd = x.double().requires_grad_(True)
    out = torch.cat([F.linear(F.silu(F.linear(xd[e0:e1], w1[e])) * F.linear(xd[e0:e1], w3[e]), w2[e])
                     for e, (e0, e1) in enumerate(zip([0, *ends[:-1]], ends))])
    reference = [out, *torch.autograd.grad((out * cotangent.double()).sum(), [xd, w1, w2, w3])]
    for got, other, want in zip(grouped, split, reference):
        torch.testing.assert_close(got, other, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    assert grouped[2][1].abs().sum() == 0 and grouped[2][0].abs().sum() > 0  # an empty expert: zero gradient


def test_the_matmul_is_chosen_by_dtype_and_alignment():
    experts = _layer(torch.float64).experts
    x = _tokens(4, torch.float64)
    assert expert_matmul(x, experts.w1, experts.w2, experts.w3) is ExpertMatmul.SPLIT  # no float64 kernel
    bf16 = copy.deepcopy(experts).bfloat16()
    assert expert_matmul(x.bfloat16(), bf16.w1, bf16.w2, bf16.w3) is ExpertMatmul.GROUPED_MM
    odd = MoE(6, 5, 4, 2, norm_topk_prob=True).experts  # rows of 20 and 24 bytes: not 16-byte aligned
    assert expert_matmul(torch.zeros(3, 6), odd.w1, odd.w2, odd.w3) is ExpertMatmul.SPLIT


# --- device-to-host syncs ----------------------------------------------------------------------

def test_the_host_read_counter_sees_the_syncs_it_must_catch():
    t = torch.tensor([1, 2, 0])
    with counted_host_reads() as counts:
        t.tolist(), t.sum().item(), torch.bincount(t), t[t > 0], t.nonzero(), torch.repeat_interleave(t)
        bool(t[0])
    assert set(counts) == {"tolist", "item", "__bool__", "aten.bincount.default", "boolean index",
                           "aten.nonzero.default", "aten.repeat_interleave.Tensor", "aten._local_scalar_dense.default"}


def test_a_moe_layer_reads_nothing_on_the_host_without_expert_parallelism():
    moe = _layer(torch.float32, aux_loss_weight=0.1, shared_hidden_dim=8)
    x = _tokens(30, torch.float32).view(2, 15, DIM)
    with counted_host_reads() as counts:
        (moe(x) * 0.5).sum().backward()
    assert not counts, counts


# --- zero tokens, and syncs, under expert parallelism ------------------------------------------


def _rank_tokens(rank: int, dtype: torch.dtype):
    n = 0 if rank == 0 else 13  # rank 0 gets no tokens at all
    return _tokens(n, dtype, seed=10 + rank), _tokens(n, dtype, seed=20 + rank)


def _ep_zero_tokens_and_syncs() -> Dict[str, object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _layer(torch.float32, aux_loss_weight=0.1)
    moe = copy.deepcopy(reference)
    parallelize_module(moe.experts, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)), ExpertParallel())
    x, cotangent = _rank_tokens(rank, torch.float32)
    x.requires_grad_(True)
    with counted_host_reads() as forward_syncs:
        y = moe(x)
    with counted_host_reads() as backward_syncs:
        y.backward(cotangent)
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for name, p in moe.named_parameters()}
    for name, p in moe.named_parameters():  # the dense gradients, as data parallelism sums them
        if not isinstance(p.grad, DTensor):
            dist.all_reduce(grads[name])
    return {"forward_syncs": dict(forward_syncs), "backward_syncs": dict(backward_syncs), "output": y.detach(),
            "input_grad": x.grad, "grads": grads}


def test_expert_parallel_zero_tokens_on_one_rank_and_one_sync_per_forward():
    results = run_on_ranks(2, _ep_zero_tokens_and_syncs, timeout=120)
    assert results[0]["output"].shape == (0, DIM) and results[0]["input_grad"].shape == (0, DIM)
    for r in results:  # the all-to-all split sizes: the one host read of the forward
        assert r["forward_syncs"] == {"tolist": 1}, r["forward_syncs"]
        assert not r["backward_syncs"], r["backward_syncs"]
    # One process on the global batch (rank 1's tokens; each rank balances its own, no group).
    reference = _layer(torch.float32, aux_loss_weight=0.1)
    x, cotangent = _rank_tokens(1, torch.float32)
    x.requires_grad_(True)
    y = reference(x)
    y.backward(cotangent)
    torch.testing.assert_close(results[1]["output"], y.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[1]["input_grad"], x.grad, rtol=1e-5, atol=1e-5)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(results[1]["grads"][name], p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_moe_layer_given_zero_tokens_returns_an_empty_output_and_gradients():
    moe = _layer(torch.float64, aux_loss_weight=0.1)
    x = torch.zeros(2, 0, DIM, dtype=torch.float64, requires_grad=True)
    out = moe(x)
    assert out.shape == (2, 0, DIM)
    out.sum().backward()
    assert x.grad.shape == x.shape and all(p.grad is not None for p in moe.experts.parameters())
    assert int(moe.tokens_per_expert.sum()) == 0


# --- activation checkpointing ------------------------------------------------------------------


def _grads_with_a_changed_choice(model, tokens: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Gradients of a loss whose backward runs after every expert bias (used for the choice of
    experts only) was changed to reverse the experts' order: a recomputation that routed anew
    would choose other experts."""
    biases = [moe.router.expert_bias for moe in model.moe_layers().values()]
    for bias in biases:
        bias.zero_()
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
    for bias in biases:
        bias.copy_(torch.linspace(10, -10, bias.numel(), dtype=bias.dtype))
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_the_routing_is_replayed_not_recomputed_under_activation_checkpointing():
    model = build_moe("moe_debug", expert_bias_update_rate=0.1).double()
    model.init_weights(0)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    plain = copy.deepcopy(model)
    apply_activation_checkpointing(model)
    reference, checkpointed = (_grads_with_a_changed_choice(m, tokens) for m in (plain, model))
    for name, grad in reference.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=0, atol=1e-13, msg=name)
