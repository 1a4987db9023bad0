"""Expert parallelism: a MoE block whose experts are split over 2 and 4 gloo ranks (each rank
routing its own tokens) matches one process running the global batch, in float64: outputs,
the gradients of the router, the inputs and the experts (gathered to full).
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module

import hyper_parallel as hp
from hyper_parallel.parallel.expert import ExpertParallel, expert_meshes
from tests.multirank import run_on_ranks

DIM, HIDDEN = 6, 5
TOL = 1e-12  # float64; the sharded run sums the same products, at most in another order


class SwiGLUExperts(nn.Module):
    """The grouped-experts contract: SwiGLU per expert over 3-D weights, rows sorted by expert."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(num_experts, HIDDEN, DIM, dtype=torch.float64) / DIM ** 0.5)
        self.w2 = nn.Parameter(torch.randn(num_experts, DIM, HIDDEN, dtype=torch.float64) / HIDDEN ** 0.5)
        self.w3 = nn.Parameter(torch.randn(num_experts, HIDDEN, DIM, dtype=torch.float64) / DIM ** 0.5)

    def forward(self, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        assert not isinstance(self.w1, DTensor) and self.w1.shape[0] == num_tokens_per_expert.numel()
        outs = [(F.silu(rows @ self.w1[e].T) * (rows @ self.w3[e].T)) @ self.w2[e].T
                for e, rows in enumerate(x.split(num_tokens_per_expert.tolist()))]
        return torch.cat(outs)


class MoE(nn.Module):
    """Router (softmax over a linear, top-k among the allowed experts), tokens sorted by expert,
    the experts, then unsorted and weighted by their router scores."""

    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(DIM, num_experts, bias=False, dtype=torch.float64)
        self.experts = SwiGLUExperts(num_experts)

    def forward(self, x: Tensor, forbidden: Optional[Tensor] = None) -> Tensor:
        scores = self.router(x).softmax(-1)
        pick = scores.detach() if forbidden is None else scores.detach().masked_fill(forbidden, -1.0)
        chosen = pick.topk(self.top_k, dim=-1).indices  # [N, k]
        weights = scores.gather(1, chosen)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=scores.shape[-1])
        out = self.experts(x[order // self.top_k], counts)
        unsorted = out.index_select(0, torch.argsort(order))
        return (unsorted.view(x.shape[0], self.top_k, x.shape[-1]) * weights.unsqueeze(-1)).sum(1)


def _rank_tokens(rank: int, world: int, routing: str):
    """Rank ``rank``'s tokens, the experts each may not choose, and the output cotangent."""
    sizes = [5 + 2 * r for r in range(world)]
    if routing == "skewed" and world == 4:
        sizes[2] = 0  # a rank with no tokens at all
    gen = torch.Generator().manual_seed(100 + rank)
    n = sizes[rank]
    x = torch.randn(n, DIM, dtype=torch.float64, generator=gen)
    cotangent = torch.randn(n, DIM, dtype=torch.float64, generator=gen)
    num_experts = 2 * world
    forbidden = torch.zeros(n, num_experts, dtype=torch.bool)
    if routing == "skewed":
        forbidden[:, -1] = True  # an expert no token chooses
        if world == 4:
            forbidden[:, 2:4] = True  # rank 1's experts get no token from anyone
        if rank == 0:
            forbidden[:, :] = True
            forbidden[:, -2] = False  # every token of rank 0 goes to one remote expert
    return x, forbidden, cotangent


def _grads(module: nn.Module) -> Dict[str, Tensor]:
    return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for name, p in
            module.named_parameters()}


def _ep_parity(routing: str, top_k: int) -> Dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = MoE(2 * world, top_k)
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    parallelize_module(model.experts, mesh, ExpertParallel())

    local = [_rank_tokens(r, world, routing) for r in range(world)]
    x, forbidden, cotangent = (t.clone() for t in local[rank])
    x.requires_grad_(True)
    y = model(x, forbidden if routing == "skewed" else None)
    y.backward(cotangent)
    for p in model.router.parameters():  # the dense gradients, as data parallelism sums them
        dist.all_reduce(p.grad)

    gx = torch.cat([t[0] for t in local]).requires_grad_(True)
    gy = reference(gx, torch.cat([t[1] for t in local]) if routing == "skewed" else None)
    gy.backward(torch.cat([t[2] for t in local]))
    lo = sum(len(t[0]) for t in local[:rank])
    hi = lo + len(x)
    ep_grads, ref_grads = _grads(model), _grads(reference)
    diffs = {name: (ep_grads[name] - ref_grads[name]).abs().max().item() for name in ref_grads}
    diffs["output"] = (y - gy[lo:hi]).abs().max().item() if len(x) else 0.0
    diffs["input_grad"] = (x.grad - gx.grad[lo:hi]).abs().max().item() if len(x) else 0.0
    w1 = model.experts.w1
    assert w1.placements == (Shard(0),) and w1.to_local().shape[0] == 2, w1
    assert all(g.abs().max() > 0 for g in ref_grads.values())
    return diffs


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("routing,top_k", [("random", 2), ("skewed", 1)])
def test_expert_parallel_matches_one_process(world, routing, top_k):
    for rank, diffs in enumerate(run_on_ranks(world, _ep_parity, routing, top_k, timeout=120)):
        assert max(diffs.values()) < TOL, (rank, diffs)


def _ep_with_fsdp(divide_by_dp_shard: bool) -> Dict[str, float]:
    """EP 2 x efsdp 2 on 4 ranks: the experts fully_shard'ed over efsdp, the router over dp_shard."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = MoE(4, 2)
    model = copy.deepcopy(reference)
    dp_shard = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    ep_mesh, efsdp_mesh = expert_meshes(dp_shard, 2)
    parallelize_module(model.experts, ep_mesh, ExpertParallel())
    hp.fully_shard(model.experts, mesh=efsdp_mesh)
    if divide_by_dp_shard:
        model.experts.set_gradient_divide_factor(world)
    hp.fully_shard(model, mesh=dp_shard)
    local = [_rank_tokens(r, world, "random") for r in range(world)]
    x, _, cotangent = local[rank]
    model(x).backward(cotangent)
    reference(torch.cat([t[0] for t in local])).backward(torch.cat([t[2] for t in local]))
    ep_grads, ref_grads = _grads(model), _grads(reference)
    # fully_shard averages over the data-parallel ranks: the reference's sum over all tokens / 4
    return {name: (ep_grads[name] - ref_grads[name] / world).abs().max().item() for name in ref_grads}


def test_experts_sharded_over_efsdp_match_one_process():
    for rank, diffs in enumerate(run_on_ranks(4, _ep_with_fsdp, True, timeout=120)):
        assert max(diffs.values()) < TOL, (rank, diffs)
    # without the divide factor the experts' gradients are ep times the dense average (documented)
    for diffs in run_on_ranks(4, _ep_with_fsdp, False, timeout=120):
        assert diffs["router.weight"] < TOL and diffs["experts.w1"] > 1e-3, diffs


def _collective_order() -> List[tuple]:
    calls = []
    real = dist.all_to_all_single

    def spy(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        calls.append((input.dtype, tuple(input.shape), input_split_sizes, output_split_sizes))
        return real(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = MoE(2 * world, 2)
    parallelize_module(model.experts, init_device_mesh("cpu", (world,), mesh_dim_names=("ep",)), ExpertParallel())
    x, _, cotangent = _rank_tokens(rank, world, "random")
    dist.all_to_all_single = spy
    try:
        model(x.requires_grad_(True)).backward(cotangent)
    finally:
        dist.all_to_all_single = real
    return calls


def test_counts_are_exchanged_before_the_tokens_and_backward_reverses_the_splits():
    for rank, calls in enumerate(run_on_ranks(2, _collective_order, timeout=60)):
        (counts_dtype, counts_shape, counts_in, _), dispatch, combine, *backward = calls
        assert counts_dtype == torch.int64 and counts_in is None, calls  # even split: 2 experts per rank
        assert dispatch[0] == combine[0] == torch.float64, calls
        assert dispatch[3] == combine[2] and dispatch[2] == combine[3], calls  # combine = inverse
        tokens = 2 * (5 + 2 * rank)
        assert dispatch[1] == (tokens, DIM) and sum(dispatch[2]) == tokens, calls
        # backward: the combine's reverse, then the dispatch's reverse
        assert [(c[2], c[3]) for c in backward] == [(combine[3], combine[2]), (dispatch[3], dispatch[2])], calls


def _apply_errors() -> List[str]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))
    errors = []

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = nn.Parameter(torch.zeros(4, 2)), nn.Parameter(torch.zeros(3, 2))

    for build in (lambda: SwiGLUExperts(6), Mixed, lambda: nn.Sequential()):
        try:
            parallelize_module(build(), mesh, ExpertParallel())
        except ValueError as err:
            errors.append(str(err))
    experts = SwiGLUExperts(4)
    parallelize_module(experts, mesh, ExpertParallel())
    try:
        parallelize_module(experts, mesh, ExpertParallel())
    except ValueError as err:
        errors.append(str(err))
    return errors


def test_apply_refuses_what_it_cannot_shard():
    for errors in run_on_ranks(4, _apply_errors, timeout=60):
        assert len(errors) == 4, errors
        assert errors[0] == "ExpertParallel: 6 experts do not divide over an ep mesh of 4 ranks"
        assert "dim-0 sizes differ: {'w1': 4, 'w2': 3}" in errors[1]
        assert "has no parameters" in errors[2]
        assert "forward is already replaced" in errors[3]


def _bad_input(case: str) -> str:
    rank = dist.get_rank()
    torch.manual_seed(0)
    experts = SwiGLUExperts(4)
    parallelize_module(experts, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)), ExpertParallel())
    x, counts = torch.randn(6, DIM, dtype=torch.float64), torch.tensor([1, 2, 0, 3])
    if rank == 1:
        if case == "sum":
            counts = torch.tensor([1, 2, 0, 4])
        elif case == "shape":
            counts = torch.tensor([3, 3])
        elif case == "negative":
            counts = torch.tensor([4, -1, 0, 3])
        elif case == "width":
            x = torch.randn(6, DIM + 1, dtype=torch.float64)
    try:
        experts(x, counts)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("case,message", [
    ("sum", "num_tokens_per_expert sums to 7 but the tokens have 6 rows"),
    ("shape", "num_tokens_per_expert must be an integer tensor of 4 entries (one per expert), got torch.int64 "
              "of shape (2,)"),
    ("negative", "num_tokens_per_expert has a negative count: [4, -1, 0, 3]"),
])
def test_bad_routing_input_raises_on_every_rank(case, message):
    mine, peer = run_on_ranks(2, _bad_input, case, timeout=60)[::-1]
    assert message in mine, mine
    assert peer == ("expert parallel dispatch: rank 1 of the ep group [0, 1] passed invalid tokens or counts "
                    "(its own error says which)")


def test_token_width_mismatch_raises_on_every_rank():
    for error in run_on_ranks(2, _bad_input, "width", timeout=60):
        assert error == f"expert parallel dispatch: the tokens' width differs across the ep group [0, 1]: " \
                        f"[{DIM}, {DIM + 1}]", error


def _mesh_layouts(ep: int):
    dp_shard = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    ep_mesh, efsdp_mesh = expert_meshes(dp_shard, ep)
    probe = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(probe, group=ep_mesh.get_group())
    return ep_mesh.mesh.tolist(), efsdp_mesh.mesh.tolist(), probe.item()


def test_expert_meshes_layout():
    # dp_shard position i = efsdp_index * ep + ep_index: ep groups are consecutive ranks
    assert [r[:2] for r in run_on_ranks(4, _mesh_layouts, 2, timeout=60)] == [
        ([0, 1], [0, 2]), ([0, 1], [1, 3]), ([2, 3], [0, 2]), ([2, 3], [1, 3])]
    assert [r[2] for r in run_on_ranks(4, _mesh_layouts, 2, timeout=60)] == [1.0, 1.0, 5.0, 5.0]
    assert [r[:2] for r in run_on_ranks(4, _mesh_layouts, 4, timeout=60)] == [
        ([0, 1, 2, 3], [r]) for r in range(4)]


def _mesh_errors() -> List[str]:
    errors = []
    for mesh, ep in ((init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",)), 3),
                     (init_device_mesh("cpu", (4,)), 2),
                     (init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")), 4),
                     (init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("a", "b", "c")), 2)):
        try:
            expert_meshes(mesh, ep)
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_expert_meshes_errors():
    for errors in run_on_ranks(4, _mesh_errors, timeout=60):
        assert errors[0] == "expert parallel degree 3 does not divide the 4 data-parallel shard ranks"
        assert errors[1].startswith("expert_meshes needs a named mesh")
        assert errors[2] == "expert parallel degree 4 does not divide the 2 data-parallel shard ranks"
        assert errors[3].startswith("expert_meshes needs the 1-D data-parallel shard mesh or the 2-D "
                                    "(replicate, shard) mesh, got 3-D")
        assert len(errors) == 4
