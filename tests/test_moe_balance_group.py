"""The load-balancing loss over the global micro-batch: the parts' shares sum to the whole
batch's loss and gradients, and MoE layers whose balance group is every rank train as one layer
on the global batch (float64) on any data-parallel x CP layout: 2 ranks as cp2 (each rank half
of every sequence), 4 ranks as dp4 or dp2 x cp2."""

from __future__ import annotations

from typing import Dict

import pytest
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
    return (torch.randn(4, 10, DIM, generator=g, dtype=torch.float64),
            torch.randn(4, 10, DIM, generator=g, dtype=torch.float64))


def _step(moe: MoE, x: torch.Tensor, weights: torch.Tensor, scale: float) -> Dict[str, torch.Tensor]:
    """A loss of the layer's output (times ``scale``, as a CP rank's share), its backward: the
    gradients (the attached aux loss included), the balance loss and the token counts."""
    ((moe(x) * weights).sum() * 0.25 * scale).backward()
    grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    return {**grads, "balance_loss": moe.balance_loss.reshape(1), "tokens": moe.tokens_per_expert.clone()}


def _layout_rank_step(dp: int, cp: int) -> Dict[str, torch.Tensor]:
    """Rank ``r`` holds data-parallel part ``r // cp`` of the sequences and CP part ``r % cp``
    of their positions; its loss is its part's, times the ranks (the gradients are averaged)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    assert dp * cp == size
    moe = _layer()
    moe.set_balance_group(dist.group.WORLD)
    x, weights = _inputs()
    seqs, positions = x.shape[0] // dp, x.shape[1] // cp
    part = (slice((rank // cp) * seqs, (rank // cp + 1) * seqs), slice((rank % cp) * positions,
                                                                        (rank % cp + 1) * positions))
    result = _step(moe, x[part], weights[part], scale=size)
    # As FSDP over the ranks: the gradients (and the reported loss) averaged, the counts summed.
    for name, value in result.items():
        dist.all_reduce(value)
        if name != "tokens":
            value /= size
    return result


@pytest.mark.parametrize("ranks, dp, cp", [(2, 1, 2), (4, 4, 1), (4, 2, 2)])
def test_every_layout_balances_the_global_batch_as_one_process(ranks, dp, cp):
    whole = _step(_layer(), *_inputs(), scale=1)
    split = run_on_ranks(ranks, _layout_rank_step, dp, cp, timeout=180)[0]
    assert sorted(split) == sorted(whole)
    assert torch.equal(split["tokens"], whole["tokens"])
    for name in whole:
        assert torch.allclose(split[name], whole[name], rtol=REL, atol=1e-14), name
    assert whole["balance_loss"].item() > 1
