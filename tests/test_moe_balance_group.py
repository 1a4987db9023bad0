"""The load-balancing loss split over the parts of the same sequences (context parallelism):
the parts' shares sum to the whole sequences' loss and gradients, and MoE layers with a balance
group of 2 gloo ranks, each holding half of every sequence, train as one layer on the whole
sequences (float64)."""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist

from hyper_parallel.models.moe_layer import MoE, load_balance_loss
from tests.multirank import run_on_ranks

DIM, HIDDEN, EXPERTS, TOP_K = 16, 24, 8, 2
REL = 1e-9


def test_the_parts_shares_sum_to_the_whole_loss_and_gradients():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, EXPERTS, generator=g, dtype=torch.float64, requires_grad=True)
    probs = logits.softmax(dim=-1)
    counts = torch.bincount(torch.topk(probs, TOP_K).indices.flatten(), minlength=EXPERTS)
    whole = load_balance_loss(probs, counts, TOP_K)
    (whole_grad,) = torch.autograd.grad(whole, logits, retain_graph=True)
    parts = [load_balance_loss(probs[rows], counts, TOP_K, torch.tensor(12)) for rows in (slice(0, 5), slice(5, 12))]
    (parts_grad,) = torch.autograd.grad(sum(parts), logits)
    assert abs(sum(parts).item() - whole.item()) <= REL * whole.item()
    assert torch.allclose(parts_grad, whole_grad, rtol=REL, atol=1e-15)
    # Each part alone balancing its own tokens is another loss (what the split must avoid).
    own = sum(load_balance_loss(probs[rows], torch.bincount(torch.topk(probs[rows], TOP_K).indices.flatten(),
                                                             minlength=EXPERTS), TOP_K) / 2
              for rows in (slice(0, 6), slice(6, 12)))
    assert abs(own.item() - whole.item()) > 1e-6


def _layer() -> MoE:
    moe = MoE(DIM, HIDDEN, EXPERTS, TOP_K, norm_topk_prob=True, aux_loss_weight=0.5)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    moe.set_aux_loss_scale(0.25)
    return moe.double()


def _inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(3, 10, DIM, generator=g, dtype=torch.float64),
            torch.randn(3, 10, DIM, generator=g, dtype=torch.float64))


def _step(moe: MoE, x: torch.Tensor, weights: torch.Tensor, scale: float) -> Dict[str, torch.Tensor]:
    """A loss of the layer's output (times ``scale``, as a CP rank's share), its backward: the
    gradients (the attached aux loss included), the balance loss and the token counts."""
    ((moe(x) * weights).sum() * 0.25 * scale).backward()
    grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    return {**grads, "balance_loss": moe.balance_loss.reshape(1), "tokens": moe.tokens_per_expert.clone()}


def _cp_rank_step() -> Dict[str, torch.Tensor]:
    rank, size = dist.get_rank(), dist.get_world_size()
    moe = _layer()
    moe.set_balance_group(dist.group.WORLD)
    x, weights = _inputs()
    part = x.shape[1] // size  # this rank's half of every sequence
    rows = slice(rank * part, (rank + 1) * part)
    result = _step(moe, x[:, rows], weights[:, rows], scale=size)
    # As FSDP over the CP ranks: the gradients (and the reported loss) averaged, the counts summed.
    for name, value in result.items():
        dist.all_reduce(value)
        if name != "tokens":
            value /= size
    return result


def test_a_balance_group_of_two_ranks_trains_as_the_whole_sequences():
    whole = _step(_layer(), *_inputs(), scale=1)
    split = run_on_ranks(2, _cp_rank_step, timeout=60)[0]
    assert sorted(split) == sorted(whole)
    assert torch.equal(split["tokens"], whole["tokens"])
    for name in whole:
        assert torch.allclose(split[name], whole[name], rtol=REL, atol=1e-14), name
    assert whole["balance_loss"].item() > 1
