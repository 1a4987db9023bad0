"""Pipeline parallelism with torch's own ``torch.distributed.pipelining`` (its ``PipelineStage``
and schedules), combined with ``hyper_parallel``'s ``fully_shard`` and
tensor parallelism (docs/fully_shard.md, "FSDP + pipeline parallel").

Each pipeline rank builds the full model on the meta device, keeps its stage(s) with the
model's stage split (Llama's ``split_stage``, in :mod:`hyper_parallel.models.llama_parallel`),
applies tensor parallelism / ``fully_shard`` to each stage module as to a whole model,
materialises it, wraps it in a :class:`ShardedPipelineStage` and runs a schedule
from :func:`build_schedule`::

    mesh = hp.init_device_mesh(device_type, (pp, dp), mesh_dim_names=("pp", "shard"))
    pp_rank, pp_group = mesh["pp"].get_local_rank(), mesh["pp"].get_group()
    ranges = stage_layers(model.cfg.n_layers, pp * stages_per_rank("1F1B"))
    stages = []
    for index in stage_indices(pp_rank, pp, "1F1B"):
        part = split_stage(model, ranges[index], first=index == 0, last=index == len(ranges) - 1)
        for block in part.layers.values():
            hp.fully_shard(block, mesh=mesh["shard"])
        hp.fully_shard(part, mesh=mesh["shard"])
        part.to_empty(device=device); part.init_weights(seed)  # the full model's values
        stages.append(ShardedPipelineStage(part, index, len(ranges), device, group=pp_group, mesh=mesh))
    schedule = build_schedule(stages, "1F1B", n_microbatches=4, loss_fn=cross_entropy)
    losses = []
    schedule.step(tokens, target=targets, losses=losses)  # first stage: tokens; last: targets
    hp.clip_grad_norm_(params, 1.0, pp_group=pp_group)    # the norm over all stages

Only the first stage passes the inputs and only the last one the targets; the other stages
call ``schedule.step()``. The last stage's ``losses`` are the per-microbatch losses already
divided by ``n_microbatches * grad_accum`` (their sum is the batch loss; see
:func:`build_schedule`). The same batch goes to every pipeline rank of one data-parallel
replica; data-parallel ranks get different batches, as without pipelining. With tensor
parallelism run ``step`` inside ``hyper_parallel.parallel.tensor.loss_parallel()``. Checkpoints:
``ModelState(parts)`` / ``OptimizerState(parts, optimizer)`` take a rank's stage modules.

A mixture of experts (:class:`~hyper_parallel.models.moe.MoETransformer`) splits the same way
(dense ``first_k_dense`` blocks and MoE blocks alike). Its load-balancing loss needs no loss
function: each MoE layer attaches it to its output, so each stage's backward includes its own
layers' part; declare the schedule's loss scale on every stage module,
``part.set_aux_loss_scale(1 / (n_microbatches * grad_accum))``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Type, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

from hyper_parallel import _torch_compat as compat
from hyper_parallel.core.fully_shard import FSDPModule

__all__ = ["SCHEDULES", "ShardedPipelineStage", "build_schedule", "stage_indices", "stage_layers", "stages_per_rank"]

Schedule = Union[PipelineScheduleSingle, PipelineScheduleMulti]

#: The supported schedules by name: torch's classes.
SCHEDULES: Dict[str, Type[Schedule]] = {
    "1F1B": Schedule1F1B,
    "GPipe": ScheduleGPipe,
    "Interleaved1F1B": ScheduleInterleaved1F1B,
}
_STAGES_PER_RANK = {"1F1B": 1, "GPipe": 1, "Interleaved1F1B": 2}


def _check_schedule(name: str) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {sorted(SCHEDULES)}")


def stages_per_rank(schedule_name: str) -> int:
    """How many stages each pipeline rank holds under the schedule: 1, or 2 for
    ``Interleaved1F1B`` (looped placement: see :func:`stage_indices`).

    Raises:
        ValueError: unknown schedule name.
    """
    _check_schedule(schedule_name)
    return _STAGES_PER_RANK[schedule_name]


def stage_indices(pp_rank: int, pp_size: int, schedule_name: str) -> List[int]:
    """The stage indices pipeline rank ``pp_rank`` of ``pp_size`` holds, in order: ``[pp_rank]``,
    or with the looped placement of interleaved schedules ``[pp_rank, pp_rank + pp_size, ...]``.

    Raises:
        ValueError: unknown schedule name, or ``pp_rank`` not in ``[0, pp_size)``.
    """
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} is not in [0, {pp_size})")
    return [pp_rank + k * pp_size for k in range(stages_per_rank(schedule_name))]


def stage_layers(n_layers: int, num_stages: int, layers_per_stage: Optional[Sequence[int]] = None) -> List[range]:
    """The blocks of each of ``num_stages`` stages, as ranges of layer indices in order.

    By default the split is even: every stage gets ``n_layers // num_stages`` blocks and the
    first ``n_layers % num_stages`` stages one more. ``layers_per_stage`` gives the counts
    explicitly (e.g. fewer blocks on the first and last stages, which also hold the embedding
    and the output projection).

    Raises:
        ValueError: more stages than blocks, or ``layers_per_stage`` does not have one entry
            of at least 1 per stage summing to ``n_layers``.
    """
    if num_stages < 1:
        raise ValueError(f"the number of pipeline stages must be at least 1, got {num_stages}")
    if layers_per_stage is None:
        if num_stages > n_layers:
            raise ValueError(f"{num_stages} pipeline stages need at least as many layers, the model has {n_layers}")
        base, extra = divmod(n_layers, num_stages)
        counts = [base + (index < extra) for index in range(num_stages)]
    else:
        counts = list(layers_per_stage)
        if (len(counts) != num_stages or sum(counts) != n_layers
                or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts)):
            raise ValueError(f"layers per stage {counts} must be {num_stages} integers >= 1 summing to the "
                             f"model's {n_layers} layers")
    starts = [sum(counts[:index]) for index in range(num_stages)]
    return [range(start, start + count) for start, count in zip(starts, counts)]


def _fsdp_modules(module: nn.Module) -> List[FSDPModule]:
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


class ShardedPipelineStage(PipelineStage):
    """torch's :class:`~torch.distributed.pipelining.PipelineStage` for a stage module wrapped
    with ``hyper_parallel.fully_shard`` (a torch ``FSDPModule``: where torch's stage would reach
    into torch's FSDP state to reduce, this one calls the ``FSDPModule`` methods).

    As torch's stage does for its FSDP: the backward of every microbatch but the stage's last
    in a schedule step accumulates unsharded gradients without reducing them and keeps the
    parameters unsharded; the last one reduce-scatters the sum (and all-reduces it with HSDP)
    and reshards. Gradients are reduced once per ``schedule.step``, so gradient accumulation
    over several steps sums sharded gradients. The stage sets ``set_requires_gradient_sync`` /
    ``set_reshard_after_backward`` of the ``fully_shard`` modules in ``submodule`` itself: off
    from construction on (torch's shape-inference pass before the first step reduces nothing),
    on only during each step's last backward.

    Arguments as torch's ``PipelineStage`` (``group``: the pipeline process group), plus
    ``mesh``: the world mesh, needed when activations between stages are DTensors (tensor
    parallelism): the stage finds their meshes among its sub-meshes by dim names; and
    ``after_forward``, called after each micro-batch's forward in a schedule (training or
    evaluation, not the shape-inference pass of the first step), e.g. to read a mixture of
    experts' statistics of that forward.
    """

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int, device: torch.device, *,
                 group: Optional[dist.ProcessGroup] = None, mesh: Optional[DeviceMesh] = None,
                 after_forward: Optional[Callable[[], None]] = None, **kwargs: Any):
        if mesh is not None and kwargs.get("get_mesh") is None:
            kwargs["get_mesh"] = lambda dim_names, _layout: mesh[dim_names]
        super().__init__(submodule, stage_index, num_stages, device, group=group, **kwargs)
        self._after_forward = after_forward
        # Gradients are reduced only inside the last backward of a step: not by the forward and
        # backward the schedule runs once to infer the shapes sent between stages.
        self._set_gradient_sync(False)

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple, kwargs: Optional[dict] = None,
                          save_forward_output: bool = True):
        output = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        if self._after_forward is not None:
            self._after_forward()
        return output

    def _set_gradient_sync(self, sync: bool) -> None:
        for module in _fsdp_modules(self.submod):
            module.set_requires_gradient_sync(sync, recurse=False)
            module.set_reshard_after_backward(sync, recurse=False)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "full":
            # fully_shard reduces a group once its inputs' gradients are computed: a weight
            # gradient computed later (split backward) would miss the reduction.
            raise ValueError(f"ShardedPipelineStage runs full backwards only (schedules {sorted(SCHEDULES)}), "
                             f"not a split {backward_type!r} backward (zero-bubble schedules)")
        self._set_gradient_sync(last_backward)
        try:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
        finally:
            self._set_gradient_sync(False)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        # A wrapped stage module is a torch FSDPModule: torch's stage then turns gradient sync
        # off for every backward and reduces here, which torch 2.13 does through torch's FSDP
        # state; ours does it through the FSDPModule methods (what torch 2.15 calls).
        if isinstance(self.submod, FSDPModule) and self.has_backward:
            self.submod.set_requires_gradient_sync(True)
            self.submod.set_reshard_after_backward(True)
            self.submod.set_is_last_backward(True)
            self.submod.finalize_backward()
        if grad_scale_factor != 1:
            self.scale_grads(grad_scale_factor)


class _ScaledLoss:
    """``loss_fn(output, target) / (n_microbatches * grad_accum)`` in training, divided by
    ``n_microbatches`` only under ``torch.no_grad()`` (evaluation: one call covers the batch)."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], n_microbatches: int,
                 grad_accum: int):
        self.loss_fn, self.n_microbatches, self.grad_accum = loss_fn, n_microbatches, grad_accum

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        divisor = self.n_microbatches * (self.grad_accum if torch.is_grad_enabled() else 1)
        return self.loss_fn(output, target) / divisor


def build_schedule(stages: Sequence[PipelineStage], name: str, n_microbatches: int,
                   loss_fn: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]], *,
                   grad_accum: int = 1, scalar_outputs: bool = False) -> Schedule:
    """torch's schedule ``name`` (see :data:`SCHEDULES`) over this rank's ``stages`` (in the
    order of :func:`stage_indices`).

    ``loss_fn(output, target)`` is the mean loss of one microbatch (e.g.
    ``hyper_parallel.parallel.tensor.cross_entropy``); the schedule calls it divided by
    ``n_microbatches * grad_accum`` and does not rescale the gradients (``scale_grads=False``),
    so that with equal microbatches, and ``grad_accum`` calls of ``step`` per optimizer step,
    the gradients (and the sum of the returned losses) equal those of one process training on
    the whole batch. ``loss_fn=None`` builds a forward-only schedule. For evaluation, call
    torch's ``schedule.eval(...)`` inside ``torch.no_grad()`` (forward only; the last stage gets
    the outputs, and the losses when ``target`` is given, then divided by ``n_microbatches``
    only, so that they sum to the batch loss; with gradients enabled the ``fully_shard`` roots
    would stay unsharded, waiting for a backward). ``scalar_outputs``: the last stage returns a
    0-dim tensor per micro-batch (e.g. its summed token loss, ``ChunkedLoss``), which the schedule
    sums instead of concatenating its micro-batches' outputs.

    Raises:
        ValueError: unknown schedule, the wrong number of stages for it, or non-positive
            ``n_microbatches``/``grad_accum``.
    """
    want = stages_per_rank(name)
    if len(stages) != want:
        raise ValueError(f"pipeline schedule {name} runs {want} stage(s) per rank, got {len(stages)}")
    if n_microbatches < 1 or grad_accum < 1:
        raise ValueError(f"n_microbatches ({n_microbatches}) and grad_accum ({grad_accum}) must be at least 1")
    scaled = None if loss_fn is None else _ScaledLoss(loss_fn, n_microbatches, grad_accum)
    schedule_cls = SCHEDULES[name]
    merge = compat.pipeline_sum_reducer() if scalar_outputs else None
    if want == 1:
        return schedule_cls(stages[0], n_microbatches, loss_fn=scaled, output_merge_spec=merge, scale_grads=False)
    return schedule_cls(list(stages), n_microbatches, loss_fn=scaled, output_merge_spec=merge, scale_grads=False)
