"""What a run reports in words: the job's one-line description, where it starts, why a
checkpoint does not fit, and the end-of-run summary."""

from __future__ import annotations

import os
from typing import Optional

import torch
from omegaconf import OmegaConf

from hyper_parallel.trainer.checkpointing import operations
from hyper_parallel.trainer.config.compose import model_overrides
from hyper_parallel.trainer.config.parallel import ParallelDims
from hyper_parallel.trainer.config.model import model_config, shape
from hyper_parallel.trainer.config.schema import TrainConfig
from hyper_parallel.trainer.job import RunSummary, TrainingJob
from hyper_parallel.trainer.checkpointing.memory_snapshots import ranks_per_node, snapshot_memory
from hyper_parallel.trainer.observability.metrics import METRICS_FILE
from hyper_parallel.trainer.setup.parallelize import build_transformer
from hyper_parallel.models.hf_weights import has_weights
from hyper_parallel.trainer.observability.sinks import TENSORBOARD_FOLDER, WANDB_FOLDER
from hyper_parallel.utils.units import format_bytes


def resume_mismatch(cfg: TrainConfig, path: str, err: Exception) -> str:
    """Why the checkpoint at ``path`` does not fit this run, and what to do about it: the model
    keys that differ from the run's ``config.yaml`` (next to the checkpoint's folder, else in
    ``output_dir``), else the first line of ``err``."""
    candidates = [os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), "config.yaml"),
                  os.path.join(cfg.output_dir, "config.yaml")]
    changed = []
    saved_path = next((p for p in candidates if os.path.isfile(p)), None)
    if saved_path is not None:
        saved = OmegaConf.load(saved_path).get("model", {})
        changed = [f"model.{k}: saved {saved[k]!r}, now {v!r}" for k, v in shape(cfg.model).items()
                   if k in saved and saved[k] != v]
    detail = "; ".join(changed) if changed else str(err).strip().splitlines()[0]
    return (f"cannot resume from {path} ({detail}). For a new run use a new "
            "output_dir (or checkpoint.folder); to continue that run use the settings it was written with")


def layout(cfg: TrainConfig, dims: ParallelDims) -> str:
    """The mesh, the pipeline schedule and its micro-batches (with ``parallel.pp > 1``) and the
    precision, e.g. ``mesh 2x2 (pp, shard), pipeline 1F1B with 4 micro-batches, fp32`` or
    ``mesh 8 (shard), bf16 with float8 tensorwise linears`` or ``mesh 2x2 (shard, cp), context
    parallel over 2 ranks (ring), fp32``."""
    shape = dims.mesh_shape
    parts = [f"mesh {'x'.join(map(str, shape.values()))} ({', '.join(shape)})"]
    if dims.pp > 1:
        per_step = " per accumulation step" if cfg.training.grad_accum_steps > 1 else ""
        parts.append(f"pipeline {cfg.parallel.schedule} with {cfg.parallel.microbatches} micro-batches{per_step}")
    if dims.cp > 1:
        parts.append(f"context parallel over {dims.cp} ranks ({cfg.parallel.cp_rotate})")
    if cfg.parallel.ep > 1:
        replicas = f" x replicate {dims.replicate}" if dims.replicate > 1 else ""
        parts.append(f"experts over ep {cfg.parallel.ep} x efsdp {dims.shard * dims.cp // cfg.parallel.ep}{replicas}")
    float8 = cfg.training.float8_mode
    parts.append(cfg.parallel.mixed_precision + (f" with float8 {float8} linears" if float8 else ""))
    return ", ".join(parts)


def describe(job: TrainingJob) -> str:
    """One line: model (its preset and any size overrides), :func:`layout`, data, loss floor."""
    cfg = job.cfg
    floor = f", loss floor {job.loss_floor:.4f}" if job.loss_floor is not None else ""
    changed = model_overrides(cfg.model) if cfg.model.path is None else {}
    name = cfg.model.name + (f" with {', '.join(f'{k}={v}' for k, v in changed.items())}" if changed else "")
    if cfg.model.path is not None:
        name = f"{job.model_parts[0].architecture} from {cfg.model.path}"
    count = sum(p.numel() for m in job.model_parts for p in m.parameters())  # global sizes (DTensors)
    if job.pipeline is not None:  # this rank's stages: the whole model's count from its shapes
        with torch.device("meta"):
            whole = build_transformer(model_config(cfg.model)).num_params()
        count_desc = (f"{whole:,} parameters ({count:,} in stage(s) {job.pipeline.stage_indices} of "
                      f"{job.pipeline.num_stages} on this rank)")
    else:
        count_desc = f"{count:,} parameters"
    return f"model {name}: {count_desc}, {layout(cfg, job.dims)}, data {cfg.data.kind}{floor}"


def snapshot_line(job: TrainingJob) -> str:
    """The start-up line of the in-memory snapshots: where, how often, how much host memory."""
    s = job.snapshots
    memory = snapshot_memory(job.state, ranks_per_node())
    partner = f"partner rank {s.partner}" if s.partner is not None else "no partner (one rank)"
    return (f"memory snapshots every {s.interval} step(s) in {s.folder.root}: about "
            f"{format_bytes(memory.node_bytes)} of host memory per node ({format_bytes(memory.rank_bytes)} per "
            f"snapshot of rank 0, which keeps its own, a replica and one being written; replica to {partner})")


def starting_point(cfg: TrainConfig, plan: Optional[operations.LoadPlan]) -> str:
    """Where training starts: a checkpoint, ``model.init_from``, or a fresh initialisation."""
    if plan is not None:
        return plan.description
    if cfg.model.init_from:
        return f"starting at step 0 from the weights in {cfg.model.init_from} (model.init_from)"
    if cfg.model.path is not None and has_weights(os.path.expanduser(cfg.model.path)):
        return f"starting at step 0 from the weights in {cfg.model.path} (model.path)"
    return "starting from scratch"


def format_summary(summary: RunSummary, cfg: TrainConfig) -> str:
    """The end-of-run report printed on rank 0."""
    lines = [f"done: steps {summary.start_step} -> {summary.end_step} in {summary.wall_time_s:.1f}s "
             f"({summary.tokens_per_s:,.0f} tokens/s)"]
    if summary.losses:
        lines.append(f"loss {summary.losses[0]:.4f} -> {summary.losses[-1]:.4f}"
                     + (f" (best achievable {summary.loss_floor:.4f})" if summary.loss_floor is not None else ""))
    lines.append(f"metrics: {os.path.join(cfg.output_dir, METRICS_FILE)}")
    lines.append(f"checkpoints: {cfg.checkpoint.folder}")
    if cfg.logging.tensorboard:
        lines.append(f"tensorboard: {os.path.join(cfg.output_dir, TENSORBOARD_FOLDER)}")
    if cfg.logging.wandb:
        lines.append(f"wandb: {os.path.join(cfg.output_dir, WANDB_FOLDER)} (project {cfg.logging.wandb_project})")
    return "\n".join(lines)
