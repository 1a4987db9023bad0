"""Pipeline parallelism in the recipe: this rank's stage modules over ``mesh["pp"]``, the
schedule that runs them, and one optimizer step through it."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hyper_parallel.chunked_loss import ChunkedLoss
from hyper_parallel.core.grad_norm import clip_grad_norm_
from hyper_parallel.models.llama_parallel import split_stage
from hyper_parallel.models.moe import MoETransformer
from hyper_parallel.parallel.pipeline import Schedule, ShardedPipelineStage, build_schedule, stage_indices, stage_layers
from hyper_parallel.parallel.tensor import cross_entropy, loss_parallel
from hyper_parallel.trainer.config.parallel import ParallelConfig
from hyper_parallel.trainer.config.model import ModelConfig, model_config
from hyper_parallel.trainer.setup.context_parallel import SequenceSplit, split_sequences
from hyper_parallel.trainer.observability.metrics import MoEStepStatistics
from hyper_parallel.trainer.setup.parallelize import build_transformer, parallelize


@dataclass
class Pipeline:
    """This rank's pipeline stages (their modules keep the whole model's parameter names) and
    the schedule that runs them over the ``pp`` process group."""

    parts: List[nn.Module]     # one module per stage of this rank, in schedule order
    stage_indices: List[int]   # their stage numbers
    num_stages: int
    schedule: Schedule         # torch.distributed.pipelining's, over this rank's stages
    pp_group: dist.ProcessGroup  # the pipeline process group (gradient norms reduce over it)
    grad_accum_steps: int      # schedule calls per batch (the schedule's losses are scaled by it)
    cp: Optional[SequenceSplit] = None  # context parallelism: each rank runs its part of the sequences
    microbatches: int = 1      # the schedule's micro-batches per call
    moe: Optional[MoEStepStatistics] = None  # a mixture of experts: its statistics of this rank's stages
    loss_chunks: int = 1       # the last stage's loss over that many pieces of each sequence (ChunkedLoss)

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    def mean_loss(self, batch: torch.Tensor, *, train: bool) -> torch.Tensor:
        """The schedule over ``batch`` (``(local_batch, seq_len + 1)`` tokens, the same on every
        stage of a data-parallel rank), one call per accumulation step (the micro-batch shapes
        the stages were set up with): forward and backward when ``train`` (gradients
        accumulate), else forward only (call under ``torch.no_grad()``). Returns the batch's
        mean loss on the last stage, 0 on the others. With context parallelism (``cp``) each
        micro-batch is this rank's part of its sequences, the schedule runs inside the CP
        context, and the loss is this rank's share of the mean (:meth:`SequenceSplit.token_loss`).
        With ``loss_chunks > 1`` the last stage returns the summed token loss of each micro-batch
        instead of its logits (:class:`ChunkedLoss`, split into micro-batches with the inputs),
        which the schedule's loss function scales into the same mean."""
        total = torch.zeros((), device=batch.device)
        for micro in batch.chunk(self.grad_accum_steps):
            inputs, labels = micro[:, :-1], micro[:, 1:]
            losses: List[torch.Tensor] = []
            # The loss's backward runs inside the schedule: vocab-parallel logits need loss_parallel
            # (SequenceSplit.context enters it too), ring attention the CP context.
            with contextlib.ExitStack() as stack:
                if self.cp is not None:
                    context = stack.enter_context(self.cp.context())
                    inputs, labels = context.shard(inputs), context.shard(labels)
                else:
                    stack.enter_context(loss_parallel())
                args = (inputs,) if self.has_first else ()
                target = labels if self.has_last else None
                # Only the last stage computes a loss; the others ignore the argument.
                chunked = {"loss": ChunkedLoss(labels, self.loss_chunks)} if self.has_last and self.loss_chunks > 1 else {}
                (self.schedule.step if train else self.schedule.eval)(*args, target=target, losses=losses, **chunked)
            for loss in losses:
                total = total + loss.detach()
        # The schedule's losses sum to the batch mean in training (each is divided by
        # microbatches x accumulation steps), to each call's mean in evaluation.
        return total if train else total / self.grad_accum_steps


def build_pipeline(model_cfg: ModelConfig, parallel: ParallelConfig, *, mesh: DeviceMesh, device: torch.device,
                   seed: int, grad_accum_steps: int, loss_chunks: int = 1, **options: Any) -> Pipeline:
    """This rank's stages of the configured model, each parallelised as a whole model would be
    (:func:`parallelize`: tensor parallelism, activation checkpointing, compile, ``fully_shard``
    over the data-parallel dims, then initialised to the whole model's values), wrapped in
    stages over ``mesh["pp"]`` and a ``parallel.schedule`` schedule of
    ``parallel.microbatches`` micro-batches per call. ``options``: :func:`parallelize`'s.
    With a ``cp`` dim in ``mesh`` the last stage's loss is :meth:`SequenceSplit.token_loss`;
    ``loss_chunks > 1``: the last stage computes it that many pieces of each sequence at a time. A
    mixture of experts' stages get expert parallelism over ``parallel.ep`` of their
    ``dp_shard`` ranks, and declare the schedule's loss scale for their aux loss."""
    with torch.device("meta"):
        whole = build_transformer(model_config(model_cfg))
    moe = None
    if isinstance(whole, MoETransformer):  # statistics rows: the whole model's MoE blocks
        moe = MoEStepStatistics(list(whole.moe_layers()), whole.cfg.num_experts, device)
    ranges = stage_layers(model_cfg.n_layers, parallel.num_stages, parallel.pp_layers_per_stage)
    pp_mesh = mesh["pp"]
    indices = stage_indices(pp_mesh.get_local_rank(), parallel.pp, parallel.schedule)
    parts, stages = [], []
    for index in indices:
        part = split_stage(whole, ranges[index], first=index == 0, last=index == len(ranges) - 1)
        # ep: the experts of this stage's MoE blocks over ep of the stage's dp_shard ranks.
        parts.append(parallelize(part, model_cfg, mesh=mesh, device=device, seed=seed, ep=parallel.ep, **options))
        after_forward = None
        if moe is not None:  # the aux loss reaches backward at the schedule's loss scale
            part.set_aux_loss_scale(1 / (parallel.microbatches * grad_accum_steps))
            after_forward = functools.partial(moe.add, part)
        # mesh: with TP the activations between stages are DTensors on its sub-meshes.
        stages.append(ShardedPipelineStage(part, index, len(ranges), device, group=pp_mesh.get_group(), mesh=mesh,
                                           after_forward=after_forward))
    cp = split_sequences(mesh, parallel.cp_rotate)
    if loss_chunks > 1:  # the last stage's output is the micro-batch's summed token loss
        loss_fn = _mean_of_summed if cp is None else cp.summed_token_loss
    else:
        loss_fn = cross_entropy if cp is None else cp.token_loss
    schedule = build_schedule(stages, parallel.schedule, parallel.microbatches, loss_fn, grad_accum=grad_accum_steps,
                              scalar_outputs=loss_chunks > 1)
    return Pipeline(parts, indices, len(ranges), schedule, pp_mesh.get_group(), grad_accum_steps, cp=cp,
                    microbatches=parallel.microbatches, moe=moe, loss_chunks=loss_chunks)


def _mean_of_summed(summed: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean token loss of a micro-batch from its summed token losses (``ChunkedLoss``'s)."""
    return summed / labels.numel()


def pipelined_step(pipeline: Pipeline, batch: torch.Tensor, optimizer: torch.optim.Optimizer,
                   *, max_grad_norm: float) -> Dict[str, torch.Tensor]:
    """:func:`~hyper_parallel.trainer.step.train_step.train_step` through the pipeline: one schedule call
    per accumulation step (``pipeline.grad_accum_steps``), clipping by the norm over all
    stages, the update. Returns 0-dim tensors: ``loss``, this data-parallel rank's mean loss on
    the last stage (0 on the others), and ``grad_norm``; for a mixture of experts also
    ``aux_loss`` and ``expert_tokens`` of this rank's stages (see :class:`MoEStepStatistics`:
    the sums over the stages are the model's)."""
    if pipeline.moe is not None:
        pipeline.moe.reset()
    loss = pipeline.mean_loss(batch, train=True)
    clip = max_grad_norm if max_grad_norm > 0 else float("inf")
    params = [p for part in pipeline.parts for p in part.parameters()]
    grad_norm = clip_grad_norm_(params, clip, pp_group=pipeline.pp_group)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    result = {"loss": loss, "grad_norm": grad_norm}
    if pipeline.moe is not None:
        result.update(pipeline.moe.result(pipeline.microbatches * pipeline.grad_accum_steps))
    return result
