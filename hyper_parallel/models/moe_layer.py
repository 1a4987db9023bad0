"""The mixture-of-experts layer: a top-k softmax router, SwiGLU experts held as grouped 3-D
weights, and the dropless :class:`MoE` layer that routes, sorts tokens by expert, runs the
experts and combines their outputs with the routing weights.

The experts (:mod:`hyper_parallel.models.grouped_experts`, re-exported here) and their contract
(an expert-parallel dispatcher wraps :class:`GroupedExperts`):
``experts(x, num_tokens_per_expert)`` takes the rows of ``x`` (``[N, dim]``) sorted by expert
and an int64 count per expert held in the weights' dim 0 (on ``x``'s device), and returns
``[N, dim]`` in the same row order.

The load-balancing loss reaches the backward without being added to the training loss (as
Megatron-LM's ``MoEAuxLossAutoScaler``): each layer attaches its weighted loss to its output
with :func:`attach_aux_loss`, whose backward injects the loss's gradient, ``aux_loss_scale``
(the factor the caller's loss is scaled by before ``backward``, e.g. ``1 / grad_accum``). So
the aux loss needs nothing from the loss function, and works under a pipeline schedule.

Balancing over the global batch: with a *balance group* (:meth:`MoE.set_balance_group`, in
training every data-parallel rank, x CP) the ranks balance the tokens of each micro-step
together, as one forward of the global micro-batch (all ranks' tokens of that micro-step)
would: the per-expert counts and token numbers are summed over the group (one all-reduce, no
gradient), and since the loss is linear in each token's probabilities, each rank computes its
tokens' share of it (:func:`load_balance_loss` with ``tokens``). The objective is then the
same on every data-parallel / CP layout of the same global micro-batches.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyper_parallel.models.grouped_experts import ExpertMatmul, GroupedExperts, expert_matmul
from hyper_parallel.models.layers import FeedForward, upcast

__all__ = ["ExpertMatmul", "GroupedExperts", "MoE", "Routing", "RoutingReplay", "TopKRouter", "attach_aux_loss",
           "checked_aux_loss_scale", "expert_matmul", "group_token_counts", "load_balance_loss",
           "replaying_routing"]


class Routing(NamedTuple):
    """A router's decision for ``N`` tokens."""

    probs: torch.Tensor    # [N, num_experts] softmax of the router logits (at least float32)
    experts: torch.Tensor  # [N, top_k] int64 chosen experts
    weights: torch.Tensor  # [N, top_k] their weights (probs of the chosen, renormalised if asked)


class TopKRouter(nn.Module):
    """Softmax over the experts of ``gate(x)``; each token goes to its ``top_k`` most probable.

    ``norm_topk_prob``: the chosen probabilities are divided by their sum (Qwen3-MoE's
    ``norm_topk_prob``); else they are used as they are. ``bias``: a learned bias in the gate.
    ``expert_bias``: a buffer added to the probabilities for the choice only, never to the
    weights (DeepSeek-V3's auxiliary-loss-free balancing; see :meth:`MoE.update_expert_bias`).
    """

    expert_bias: Optional[torch.Tensor]

    def __init__(self, dim: int, num_experts: int, top_k: int, *, norm_topk_prob: bool, bias: bool = False,
                 expert_bias: bool = False):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = nn.Linear(dim, num_experts, bias=bias)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def forward(self, x: torch.Tensor) -> Routing:
        probs = F.softmax(upcast(self.gate(x)), dim=-1)
        scores = probs if self.expert_bias is None else probs + self.expert_bias.to(probs.dtype)
        experts = _chosen_experts(scores, self.top_k)
        weights = probs.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(probs, experts, weights)


def load_balance_loss(probs: torch.Tensor, tokens_per_expert: torch.Tensor, top_k: int,
                      tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The Switch Transformer's auxiliary load-balancing loss for top-k routing (as
    DeepSeek normalises it): ``E / (k N) * sum_e count_e * mean_t probs[t, e]`` over ``N``
    tokens and ``E`` experts. 1 when the tokens and the probabilities are spread evenly, up to
    ``E / k`` when all go to the same experts. Its gradient reaches the router through
    ``probs``; the counts are constants.

    ``tokens`` (a 0-dim tensor): ``probs`` are a part of a set of ``N = tokens`` tokens whose
    counts are ``tokens_per_expert``; the result is this part's share ``E / (k N^2) * sum_e
    count_e * sum_t probs[t, e]``, and the shares of the parts sum to the whole set's loss
    (values and gradients). Default: ``probs`` are the whole set.
    """
    num_experts = probs.shape[1]
    if tokens is None:
        if probs.shape[0] == 0:
            return probs.sum()  # 0, attached to the graph
        share = tokens_per_expert.to(probs.dtype) * probs.mean(dim=0)
        return share.sum() * (num_experts / (top_k * probs.shape[0]))
    whole = tokens.to(probs.dtype).clamp_min(1)
    share = tokens_per_expert.to(probs.dtype) * probs.sum(dim=0)
    return share.sum() * num_experts / (top_k * whole * whole)


@torch.compiler.disable
def group_token_counts(counts: torch.Tensor, tokens: int,
                       group: dist.ProcessGroup) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(counts, tokens)`` summed over ``group``'s ranks (one all-reduce, no autograd):
    int64 per-expert counts ``[num_experts]`` and a 0-dim token count. Collective."""
    summed = torch.cat([counts.detach().to(torch.int64), counts.new_full((1,), tokens, dtype=torch.int64)])
    dist.all_reduce(summed, group=group)
    return summed[:-1], summed[-1]


class RoutingReplay:
    """The routers' choices of one checkpointed forward, replayed by its recomputation.

    Under activation checkpointing the recomputation must route every token as the forward did:
    a recomputed top-k that differed (ties, nondeterministic kernels, an expert bias changed in
    between) would give other gradients or, under expert parallelism, other all-to-all sizes on
    one rank only (its peers would wait forever). Inside :func:`replaying_routing` the first run
    records each router's chosen experts in order; after :meth:`replay` the next runs take them.
    One object per checkpointed call: it lives as long as that call's recomputation can happen.
    """

    def __init__(self) -> None:
        self.saved: List[torch.Tensor] = []
        self.replaying = False
        self.position = 0

    def choose(self, scores: torch.Tensor, top_k: int) -> torch.Tensor:
        if not self.replaying:
            experts = torch.topk(scores.detach(), top_k, dim=-1).indices
            self.saved.append(experts)
            return experts
        experts = self.saved[self.position]
        self.position += 1
        return experts

    def replay(self) -> None:
        """From now on, return the recorded choices (from the first)."""
        self.replaying, self.position = True, 0


_ROUTING_REPLAY: ContextVar[Optional[RoutingReplay]] = ContextVar("routing_replay", default=None)


@contextmanager
def replaying_routing(replay: RoutingReplay) -> Iterator[None]:
    """Routers inside the block record their choices in ``replay`` or replay them."""
    token = _ROUTING_REPLAY.set(replay)
    try:
        yield
    finally:
        _ROUTING_REPLAY.reset(token)


def _chosen_experts(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    replay = _ROUTING_REPLAY.get()
    # (the scores detached: the choice carries no gradient, and autograd saves nothing for it)
    return torch.topk(scores.detach(), top_k, dim=-1).indices if replay is None else replay.choose(scores, top_k)


class _AttachAuxLoss(torch.autograd.Function):
    """Forward: ``output`` as it is. Backward: ``output``'s gradient, and 1 for ``aux``."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(aux)
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # type: ignore[override]
        (aux,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux)


def attach_aux_loss(output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """``output`` (the same values), through which any backward that reaches it also
    backpropagates ``aux`` (a 0-dim loss) as if ``aux`` had been added to the loss whose
    backward it is: ``aux``'s gradient is 1 (scale ``aux`` by the loss's own scale first)."""
    return _AttachAuxLoss.apply(output, aux)


def checked_aux_loss_scale(scale: float) -> float:
    """``scale`` as a float.

    Raises:
        ValueError: ``scale`` is not a finite number > 0.
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"aux loss scale {scale!r} must be a finite number > 0")
    return float(scale)


class MoE(nn.Module):
    """Dropless mixture of experts: every token goes to its ``top_k`` experts (no capacity limit).

    ``forward(x)`` (``[..., dim]``) routes the tokens, sorts the ``(token, expert)`` pairs by
    expert (stable), calls ``self.experts(x_sorted, counts)``, puts the outputs back in token
    order and sums each token's ``top_k`` outputs weighted by the routing weights (in at least
    float32), then adds the shared expert's output (a dense SwiGLU over every token), if any.

    After each forward: ``tokens_per_expert`` (buffer, int64) holds the pairs each expert got,
    and ``balance_loss`` the unweighted :func:`load_balance_loss`, detached (when
    ``aux_loss_weight > 0``, else None). With an ``expert_bias`` router, the counts of forwards
    with gradients enabled (training, not a ``no_grad`` evaluation) also add up in
    ``pending_tokens_per_expert`` until :meth:`update_expert_bias`.

    With ``aux_loss_weight > 0`` and gradients enabled the output carries
    ``aux_loss_weight * aux_loss_scale * balance_loss`` (:func:`attach_aux_loss`): the backward
    of a loss computed from it includes the balancing loss's gradients. ``aux_loss_scale``
    (default 1) must be the factor that loss is multiplied by before ``backward`` (e.g.
    ``1 / grad_accum``); set it with :meth:`set_aux_loss_scale`.

    With a balance group (:meth:`set_balance_group`: the data-parallel and CP ranks that run the
    same micro-step, each on its part of the global micro-batch) the group's ranks balance their
    tokens together: the counts and token numbers are summed over the group, each rank's
    ``balance_loss`` is ``group size x`` its tokens' share (:func:`load_balance_loss` with
    ``tokens``), so the group's mean of ``balance_loss`` and gradients, as data-parallel
    averaging takes them, are the loss and gradients of the global micro-batch, whatever the
    layout. ``tokens_per_expert`` stays this rank's own.
    """

    shared_expert: Optional[FeedForward]
    balance_loss: Optional[torch.Tensor]
    balance_group: Optional[dist.ProcessGroup]

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, *, norm_topk_prob: bool,
                 shared_hidden_dim: int = 0, router_bias: bool = False, expert_bias: bool = False,
                 aux_loss_weight: float = 0.0):
        super().__init__()
        self.num_experts, self.top_k, self.aux_loss_weight = num_experts, top_k, aux_loss_weight
        self.aux_loss_scale = 1.0
        self.router = TopKRouter(dim, num_experts, top_k, norm_topk_prob=norm_topk_prob, bias=router_bias,
                                 expert_bias=expert_bias)
        self.experts = GroupedExperts(dim, hidden_dim, num_experts)
        self.shared_expert = FeedForward(dim, shared_hidden_dim) if shared_hidden_dim else None
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.register_buffer("pending_tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64),
                             persistent=False)
        self.balance_loss = None
        self.balance_group = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        routing = self.router(x)
        pairs = routing.experts.flatten()
        # Everything below stays on the device: no host sync without expert parallelism (a
        # scatter-add where bincount would read the largest index on the host; index_select
        # where boolean masks would size their output on the host).
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=pairs.device)
        counts.scatter_add_(0, pairs, torch.ones_like(pairs))
        order = torch.argsort(pairs, stable=True)
        routed = self.experts(x.index_select(0, order // self.top_k), counts)
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        # Back in token order, each token's top_k outputs weighted and summed by one batched
        # matmul (in at least float32, as the weights).
        dtype = torch.promote_types(routed.dtype, routing.weights.dtype)
        unsorted = routed.index_select(0, inverse).view(x.shape[0], self.top_k, shape[-1]).to(dtype)
        out = torch.bmm(routing.weights.to(dtype).unsqueeze(1), unsorted).squeeze(1).type_as(x)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        training = torch.is_grad_enabled()  # not a no_grad evaluation
        with torch.no_grad():
            self.tokens_per_expert.copy_(counts)
            if self.router.expert_bias is not None and training:
                self.pending_tokens_per_expert.add_(counts)
        out = out.view(shape)
        self.balance_loss = None
        if self.aux_loss_weight > 0:
            if self.balance_group is None:
                balance = load_balance_loss(routing.probs, counts, self.top_k)
            else:  # this rank's share of its group's loss, times the group size (see the class docstring)
                group_counts, tokens = group_token_counts(counts, x.shape[0], self.balance_group)
                share = load_balance_loss(routing.probs, group_counts, self.top_k, tokens)
                balance = share * dist.get_world_size(self.balance_group)
            self.balance_loss = balance.detach()
            if training:
                out = attach_aux_loss(out, balance * (self.aux_loss_weight * self.aux_loss_scale))
        return out

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Zero the token counts and the router's expert bias (a new model's state)."""
        self.tokens_per_expert.zero_()
        self.pending_tokens_per_expert.zero_()
        if self.router.expert_bias is not None:
            self.router.expert_bias.zero_()

    def set_aux_loss_scale(self, scale: float) -> None:
        """The factor the training loss is multiplied by before ``backward`` (e.g. ``1 /
        grad_accum``; under a pipeline schedule ``1 / (microbatches x grad_accum)``): the
        balancing loss's gradient is scaled by it too.

        Raises:
            ValueError: ``scale`` is not a finite number > 0.
        """
        self.aux_loss_scale = checked_aux_loss_scale(scale)

    def set_balance_group(self, group: Optional[dist.ProcessGroup]) -> None:
        """The ranks whose tokens this layer balances together: the ranks whose forwards are
        parts of one global micro-batch (in training every data-parallel rank, x CP; all must
        run every forward, which all-reduces the counts over them); None: each forward balances
        its own tokens."""
        self.balance_group = group

    @torch.no_grad()
    def update_expert_bias(self, rate: float, group: Optional[dist.ProcessGroup] = None) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: ``expert_bias += rate * sign(mean - count)``
        per expert (centred to mean 0), from the counts since the last update (summed over
        ``group``'s ranks when given), which are then reset.

        Raises:
            ValueError: the router has no ``expert_bias``.
        """
        bias = self.router.expert_bias
        if bias is None:
            raise ValueError("this MoE layer's router has no expert_bias (expert_bias_update_rate is 0)")
        counts = self.pending_tokens_per_expert.clone()
        if group is not None:
            dist.all_reduce(counts, group=group)
        counts = counts.to(bias.dtype)
        delta = rate * torch.sign(counts.mean() - counts)
        bias.add_(delta - delta.mean())
        self.pending_tokens_per_expert.zero_()
