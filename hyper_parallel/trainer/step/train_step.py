"""One optimizer step: gradient accumulation over micro-batches, clipping, the update."""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from hyper_parallel.chunked_loss import ChunkedLoss
from hyper_parallel.core.fully_shard import FSDPModule
from hyper_parallel.core.grad_norm import clip_grad_norm_
from hyper_parallel.models.contract import RecipeModel
from hyper_parallel.models.moe import MoETransformer
from hyper_parallel.parallel.tensor import cross_entropy
from hyper_parallel.trainer.setup.context_parallel import SequenceSplit, micro_batch_context
from hyper_parallel.models.float8 import precompute_scales
from hyper_parallel.trainer.observability.metrics import MoEStepStatistics


def _set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    if isinstance(model, FSDPModule):  # a plain model (the tests' reference) has no sync to skip
        model.set_requires_gradient_sync(enabled)


def next_token_loss(model: nn.Module, batch: torch.Tensor, loss_chunks: int = 1) -> torch.Tensor:
    """The mean next-token cross entropy of ``batch`` ``(samples, seq_len + 1)`` in at least
    float32, the logits computed ``loss_chunks`` pieces of the sequence at a time
    (:class:`~hyper_parallel.chunked_loss.ChunkedLoss`; 1: whole). Vocabulary-parallel logits:
    inside ``loss_parallel``."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    if loss_chunks == 1:
        return cross_entropy(model(inputs), targets)
    return model(inputs, loss=ChunkedLoss(targets, loss_chunks)) / targets.numel()


def train_step(model: nn.Module, batch: torch.Tensor, optimizer: torch.optim.Optimizer,
               *, grad_accum_steps: int, max_grad_norm: float, float8_scales: bool = False,
               cp: Optional[SequenceSplit] = None, loss_chunks: int = 1,
               document_eos: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """One optimizer step on this data-parallel rank's slice of the global batch (the same on
    every tensor-parallel rank of it).

    ``batch`` is ``(local_batch, seq_len + 1)``; it is split into ``grad_accum_steps``
    micro-batches whose gradients accumulate locally, synchronised only on the last one.
    Returns 0-dim tensors (no host sync): this rank's mean ``loss`` (the cross-entropy) and the
    global ``grad_norm`` before clipping; for a mixture of experts also ``aux_loss``, this
    rank's mean load-balancing loss, whose gradients each micro-batch's backward includes
    (each MoE layer attaches it to its output, scaled as the loss: see
    :meth:`~hyper_parallel.models.moe.MoETransformer.set_aux_loss_scale`), and
    ``expert_tokens``, the (token, expert) pairs each expert got on this rank over the step
    (``[moe blocks, num_experts]``, float). ``float8_scales``: after the step, compute the next
    all-gathers' float8 scales of all tensorwise float8 weights with one all-reduce. ``cp``:
    context parallelism (``batch`` is the same on every CP rank; each computes its part of the
    sequences, forward and backward under the CP context; ``loss`` is then this rank's share of
    the mean over the data-parallel x CP group, see :class:`SequenceSplit`). A mixture of
    experts balances each micro-step over all data-parallel (x CP) ranks: its ``aux_loss`` is
    then ``ranks x`` this rank's share of the global micro-batch's balancing loss (see
    :meth:`~hyper_parallel.models.moe.MoETransformer.set_balance_group`).
    ``loss_chunks``: the loss computed that many pieces of each sequence at a time, the logits
    never whole (:class:`~hyper_parallel.chunked_loss.ChunkedLoss`; the same loss).
    ``document_eos``: document masks, each packed document ending at this token.
    """
    micro_batches = batch.chunk(grad_accum_steps)
    loss_sum = torch.zeros((), device=batch.device)
    stats = None
    if isinstance(model, RecipeModel):  # a load-balancing loss rides into backward on the model's output
        model.set_aux_loss_scale(1 / grad_accum_steps)
    if isinstance(model, MoETransformer):
        stats = MoEStepStatistics(list(model.moe_layers()), model.cfg.num_experts, batch.device)
    for i, micro in enumerate(micro_batches):
        _set_gradient_sync(model, i == len(micro_batches) - 1)
        # The loss in at least fp32; vocab-parallel logits (tensor parallelism) never gathered.
        with micro_batch_context(cp, micro, document_eos) as context:
            if cp is not None:
                loss = cp.loss(model, micro, context, loss_chunks)
            else:
                loss = next_token_loss(model, micro, loss_chunks)
            if stats is not None:  # before backward: activation checkpointing reruns forwards
                stats.add(model)
            (loss / grad_accum_steps).backward()
        loss_sum = loss_sum + loss.detach()
    clip = max_grad_norm if max_grad_norm > 0 else float("inf")
    grad_norm = clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    if float8_scales:
        precompute_scales(model)
    optimizer.zero_grad(set_to_none=True)
    result = {"loss": loss_sum / grad_accum_steps, "grad_norm": grad_norm}
    if stats is not None:
        result.update(stats.result(grad_accum_steps))
    return result
