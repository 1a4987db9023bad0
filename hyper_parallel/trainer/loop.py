"""The training loop shared by the recipes: setup from config, steps, checkpoints, summary."""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar

import torch
from omegaconf import OmegaConf

from hyper_parallel._torch_compat import flatten_mesh
from hyper_parallel.checkpoint import CheckpointError
from hyper_parallel.checkpoint import CheckpointManager
from hyper_parallel.utils.fileio import RefusedFileError, write_file_atomically
from hyper_parallel.data import DistributedBatchLoader, TokenSource
from hyper_parallel.models.moe import MoETransformer
from hyper_parallel.platform import Platform
from hyper_parallel.trainer.checkpointing import operations
from hyper_parallel.trainer.step.agreement import JobFailed, count_ranks, fail_together, step_votes, together
from hyper_parallel.trainer.config.compose import ConfigError, ValidConfig
from hyper_parallel.trainer.config.data import DataConfig
from hyper_parallel.trainer.config.parallel import ParallelConfig, ParallelDims
from hyper_parallel.trainer.config.model import model_config
from hyper_parallel.trainer.config.schema import TrainConfig, TrainingConfig
from hyper_parallel.trainer.setup.context_parallel import split_sequences
from hyper_parallel.trainer.step.evaluation import Evaluator, build_sources
from hyper_parallel.trainer.job import RunSummary, TrainingJob
from hyper_parallel.trainer.checkpointing.memory_snapshots import build_snapshots, job_identity
from hyper_parallel.trainer.observability.metrics import MetricsLogger, moe_record, moe_statistics
from hyper_parallel.trainer.observability.performance import (ProfilerWindow, Throughput, memory_record,
                                                              model_flops_per_token, peak_tflops)
from hyper_parallel.trainer.setup.optimizer import build_optimizer
from hyper_parallel.trainer.setup.parallelize import build_mesh, build_model
from hyper_parallel.trainer.setup.pipeline_parallel import build_pipeline, pipelined_step
from hyper_parallel.trainer.launch.recovery import start_from
from hyper_parallel.trainer.launch.reporting import describe, format_summary, resume_mismatch, snapshot_line, starting_point
from hyper_parallel.trainer.checkpointing.saving import CheckpointSaver
from hyper_parallel.trainer.step.schedule import WarmupCosineSchedule
from hyper_parallel.trainer.observability.sinks import SinkError, WandbSettings, wandb_settings
from hyper_parallel.trainer.launch.signals import StopRequest
from hyper_parallel.trainer.checkpointing.state import SAVED_ONLY, RNGState, training_state
from hyper_parallel.trainer.step.train_step import train_step

T = TypeVar("T")


def build_loader(data: DataConfig, training: TrainingConfig, parallel: ParallelConfig, vocab_size: int,
                 dp_rank: int, dp_size: int, source: Optional[TokenSource] = None) -> DistributedBatchLoader:
    """The data loader of this rank over ``source`` (default: the training split of ``data``),
    each global batch cut into the global micro-batches of the steps' forwards first (gradient
    accumulation x pipeline micro-batches), so those hold the same rows on every layout."""
    if source is None:
        source = build_sources(data, seq_len=training.seq_len, seed=training.seed, vocab_size=vocab_size,
                               with_val=False).train
    pipeline = parallel.microbatches if parallel.pp > 1 else 1
    return DistributedBatchLoader(source, training.global_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                                  seed=training.seed, shuffle=data.shuffles(),
                                  micro_batches=training.grad_accum_steps * pipeline)


def _load_data(cfg: TrainConfig, dims: ParallelDims, rank: int,
               device: torch.device) -> Tuple[DistributedBatchLoader, Optional[Evaluator]]:
    """This rank's loader (its part of the data validated: each data-parallel rank checks
    1/dp_size) and the
    evaluator of the held-out split, if evaluation is on."""
    t, dp_rank = cfg.training, dims.dp_rank(rank)
    try:
        sources = build_sources(cfg.data, seq_len=t.seq_len, seed=t.seed, vocab_size=cfg.model.vocab_size,
                                with_val=cfg.eval.every > 0)
        loader = build_loader(cfg.data, t, cfg.parallel, cfg.model.vocab_size, dp_rank, dims.dp_size,
                              source=sources.train)
        loader.source.validate(dp_rank, dims.dp_size)
        evaluator = None if sources.val is None else Evaluator(
            sources.val, global_batch_size=t.global_batch_size, dp_rank=dp_rank, dp_size=dims.dp_size,
            every=cfg.eval.every, steps=cfg.eval.steps, device=device, tp_size=dims.tp)
    except (ValueError, TypeError, FileNotFoundError) as err:
        raise ConfigError(f"data={cfg.data.kind}: {err}") from None
    return loader, evaluator


def _as_config_error(make: Callable[[], T]) -> T:
    """``make()``, its refusal of an output file or folder (a symbolic link, a file where a
    folder belongs, a sink that cannot start, another job's lock) as a one-line ConfigError."""
    try:
        return make()
    except (CheckpointError, SinkError, RefusedFileError, OSError) as err:
        raise ConfigError((str(err).strip().splitlines() or [type(err).__name__])[0]) from None


def build_job(cfg: TrainConfig, dims: ParallelDims, platform: Platform,
              wandb: Optional[WandbSettings] = None,
              meta_model: Optional[torch.nn.Module] = None) -> TrainingJob:
    """Data, mesh, sharded model, optimizer, schedule, checkpoint manager and logger (and the
    W&B run of ``wandb``, when given). ``meta_model``: the model validation already built on the
    meta device (``ValidConfig.meta_model``), sharded and initialised instead of a new one.

    Requires an initialised default process group of ``dims.world_size`` ranks.

    Raises:
        JobFailed: on every rank, when the data or ``model.init_from`` cannot be read or do
            not fit the model on any rank, or the checkpoint folder, ``metrics.jsonl`` or a
            sink's folder or file is refused (see ``checkpointing/output_files.py``, checked before start-up).
    """
    started_at = time.monotonic()
    t, rank = cfg.training, platform.rank
    device = platform.current_device() if t.device == "auto" else torch.device("cpu")
    torch.manual_seed(t.seed)
    loader, evaluator = together(device, lambda: _load_data(cfg, dims, rank, device))
    p = cfg.profiling
    profiler = ProfilerWindow(p.folder, rank=rank, start=p.start_step, steps=p.steps, platform=platform,
                              memory_snapshot=p.memory_snapshot) if p.enable else None
    mesh = build_mesh(dims, device.type)
    options = dict(mesh=mesh, device=device, seed=t.seed, mixed_precision=cfg.parallel.mixed_precision,
                   reshard_after_forward=cfg.parallel.reshard_after_forward,
                   compile_backend=t.compile_backend if t.compile else None,
                   float8_recipe=t.float8_mode)
    pipeline = None
    if dims.pp > 1:
        pipeline = together(device, lambda: build_pipeline(cfg.model, cfg.parallel, grad_accum_steps=t.grad_accum_steps,
                                                           loss_chunks=t.loss_chunks, **options))
    parts = (pipeline.parts if pipeline is not None
             else [together(device, lambda: build_model(cfg.model, ep=cfg.parallel.ep,
                                                               meta_model=meta_model, **options))])
    # Every rank starts training from the same global generator state (the checkpoint stores it).
    torch.manual_seed(t.seed + 1)
    optimizer = build_optimizer(parts, cfg.optim)
    schedule = WarmupCosineSchedule(optimizer, peak_lr=cfg.optim.lr, warmup_steps=cfg.optim.warmup_steps,
                                    total_steps=t.steps, min_lr_ratio=cfg.optim.min_lr_ratio)
    # Async checkpoints stage in the background: this loop changes the saved tensors in place
    # only in optimizer.step(), which waits for staging (docs/checkpoint.md, "Async save").
    manager = together(device, lambda: _as_config_error(lambda: CheckpointManager(
        cfg.checkpoint.folder, interval=cfg.checkpoint.interval, keep_last_n=cfg.checkpoint.keep_last_n,
        async_save=cfg.checkpoint.async_save, stage_in_background=cfg.checkpoint.async_save)))
    snapshots = None
    if cfg.checkpoint.memory_interval:
        snapshots = together(device, lambda: _as_config_error(lambda: build_snapshots(cfg.checkpoint, job_identity(cfg), rank, dims.world_size)))
    log = together(device, lambda: _as_config_error(lambda: MetricsLogger(
        cfg.output_dir, total_steps=t.steps, is_main=rank == 0, log_every=cfg.logging.log_every,
        tensorboard=cfg.logging.tensorboard, wandb=wandb)))
    return TrainingJob(
        cfg=cfg, dims=dims, platform=platform, device=device, mesh=mesh, model_parts=parts,
        optimizer=optimizer, schedule=schedule, loader=loader, manager=manager,
        state=training_state(parts, optimizer, schedule, loader, RNGState(platform.device_module), dims,
                             pp_group=pipeline.pp_group if pipeline is not None else None),
        log=log, loss_floor=loader.source.loss_floor(),
        throughput=Throughput(model_flops_per_token(model_config(cfg.model), t.seq_len, meta_model),
                              tokens_per_step=t.global_batch_size * t.seq_len, world_size=dims.world_size,
                              peak=peak_tflops(platform, t.peak_tflops)),
        started_at=started_at, evaluator=evaluator, profiler=profiler, pipeline=pipeline,
        cp=split_sequences(mesh, cfg.parallel.cp_rotate), snapshots=snapshots,
    )


def resume(job: TrainingJob) -> Optional[operations.LoadPlan]:
    """Load what ``checkpoint`` says to start from (see :func:`operations.plan_load`): this
    job's own latest checkpoint (or, if that is corrupt, the newest sound one before it), a
    given step, or ``checkpoint.load_from``; None: nothing.

    Raises:
        JobFailed: on every rank, when the checkpoint does not fit this run (one line naming
            the difference and the way out).
    """
    cfg = job.cfg

    def load() -> Optional[operations.LoadPlan]:
        plan = operations.plan_load(cfg.checkpoint, [key for key in job.state if key not in SAVED_ONLY])
        if plan is None:
            return None
        try:
            if not plan.newest_own:
                operations.load(plan, job.state)
                return plan
            # The manager skips a corrupt newest checkpoint for the previous one (one warning).
            step = job.manager.load_latest({key: job.state[key] for key in plan.keys})
        except (CheckpointError, ValueError, KeyError) as err:  # KeyError: parameters added or removed
            raise ConfigError(resume_mismatch(cfg, plan.path, err)) from None
        if step == plan.start_step:
            return plan
        path = job.manager.checkpoint_path(step)
        return plan._replace(path=path, start_step=step,
                             description=f"resumed from {path} ({plan.path} is corrupt)")

    return together(job.device, load)


def run_training(config: ValidConfig, platform: Platform) -> RunSummary:
    """Train as configured (``config.composed`` is saved as ``config.yaml``), resuming from
    ``checkpoint.folder`` when it holds a checkpoint.

    Raises:
        JobFailed: on every rank, when any rank found bad data, an unreadable
            ``model.init_from``, a checkpoint that does not fit, or a non-finite loss.
    """
    cfg = config.cfg
    job = build_job(cfg, config.dims, platform, wandb=wandb_settings(config.composed), meta_model=config.meta_model)
    plan, recovery_lines, recovered = start_from(job, lambda: resume(job))
    step = plan.start_step if plan is not None else 0
    if platform.rank == 0:
        write_file_atomically(os.path.join(cfg.output_dir, "config.yaml"),
                              OmegaConf.to_yaml(config.composed).encode())
    job.log.print(describe(job))
    if job.snapshots is not None:
        job.log.print(snapshot_line(job))
    for line in recovery_lines:
        job.log.print(line)
    if recovered is not None:
        job.log.log_event(recovered)
    job.log.print(starting_point(cfg, plan))
    if plan is not None and "optim" in plan.keys:
        for line in operations.apply_optim_config(job.optimizer, cfg.optim):
            job.log.print(line)
    if step >= cfg.training.steps:
        job.log.print(f"the latest checkpoint is at step {step} >= training.steps={cfg.training.steps}: "
                      "nothing to train")
        if job.snapshots is not None:
            job.snapshots.remove()
        job.log.close()
        return RunSummary(start_step=step, end_step=step, loss_floor=job.loss_floor)
    stop = StopRequest()
    if cfg.checkpoint.save_on_sigterm:
        stop.install()
    try:
        summary = train_loop(job, step, stop)
        if job.snapshots is not None:  # a finished (or stopped and saved) job needs none
            job.snapshots.remove()
            job.log.print(job.snapshots.counts_line())
        job.log.print(format_summary(summary, cfg))
    finally:
        stop.uninstall()
        if job.profiler is not None:
            job.profiler.close()
        job.log.close()
    return summary


def _peek_batch(job: TrainingJob, step: int) -> Tuple[Optional[torch.Tensor], Optional[ConfigError]]:
    """This rank's batch for optimizer step ``step`` (1-based), or the problem with it."""
    try:
        return job.loader.peek().to(job.device), None
    except ValueError as err:  # e.g. a token id outside the vocabulary, deep in a data file
        return None, ConfigError(f"data={job.cfg.data.kind}, step {step}: {err}")


def expert_bias_update(job: TrainingJob) -> Optional[Callable[[], None]]:
    """What moves the routers' expert biases after each optimizer step (DeepSeek-V3's loss-free
    balancing, ``model.moe.expert_bias_update_rate > 0``): each MoE part's
    ``update_expert_bias`` from the step's token counts summed over the data-parallel ranks of its
    pipeline stage (every rank without pipeline parallelism); None when there is nothing to move."""
    moe = job.cfg.model.moe
    if moe is None or moe.expert_bias_update_rate <= 0:
        return None
    names = tuple(name for name in job.mesh.mesh_dim_names if name != "pp")
    group = None if names == job.mesh.mesh_dim_names else flatten_mesh(job.mesh[names], "dp_all").get_group()
    parts = [part for part in job.model_parts if isinstance(part, MoETransformer)]

    def update() -> None:
        for part in parts:
            part.update_expert_bias(group)
    return update


def train_loop(job: TrainingJob, step: int, stop: StopRequest) -> RunSummary:
    """Steps ``step+1 .. training.steps`` with metrics, evaluation and checkpoints; stops early
    (after a final checkpoint) when any rank got SIGTERM or ran out of time, or after
    ``training.stop_after_steps``. A SIGTERM is agreed at the end of the step it arrived in (or
    of the evaluation it arrived in); the stopping step is then saved without an evaluation.

    Each step's batch is read before the previous step's all-reduce, which carries every
    rank's verdict on it, so a bad batch on one rank stops all ranks together.

    Raises:
        JobFailed: on every rank, when a batch is invalid on any rank (e.g. a token id >=
            vocab_size), the loss or gradient norm is not finite (nothing of that step
            is saved), or a checkpoint does not fit on the disk.
    """
    t, platform = job.cfg.training, job.platform
    summary = RunSummary(start_step=step, end_step=step, loss_floor=job.loss_floor)
    tokens_per_step = t.global_batch_size * t.seq_len
    started = time.perf_counter()
    limits = operations.StopRule(start_step=step, stop_after_steps=t.stop_after_steps,
                                 time_limit_minutes=t.time_limit_minutes, started_at=job.started_at)
    saver = CheckpointSaver(job.manager, job.device)
    update_expert_bias = expert_bias_update(job)
    document_eos = job.loader.source.eos_id if t.document_mask else None
    batch, error = _peek_batch(job, step + 1)
    fail_together(error, job.device)
    while step < t.steps:
        if job.profiler is not None:
            job.profiler.before_step(step + 1)
        step_start = time.perf_counter()
        platform.reset_peak_memory()
        lr = job.schedule.step()
        if job.pipeline is not None:
            result = pipelined_step(job.pipeline, batch, job.optimizer, max_grad_norm=t.max_grad_norm)
        else:
            result = train_step(job.model, batch, job.optimizer, grad_accum_steps=t.grad_accum_steps,
                                max_grad_norm=t.max_grad_norm,
                                float8_scales=t.float8_mode == "tensorwise", cp=job.cp, loss_chunks=t.loss_chunks,
                                document_eos=document_eos)
        if update_expert_bias is not None:
            update_expert_bias()
        job.loader.advance()
        step += 1
        batch, error = _peek_batch(job, step + 1) if step < t.steps else (None, None)
        # One collective per step: the global mean loss, whether any rank got SIGTERM or ran
        # out of time, how many ranks cannot read their next batch, and on how many the last
        # memory snapshot is still in flight (the next one then waits, not the step).
        votes = step_votes(result["loss"], sigterm=stop.requested, bad_batch=error is not None,
                           out_of_time=limits.out_of_time(time.perf_counter() - step_start),
                           snapshot_busy=job.snapshots is not None and job.snapshots.in_flight(),
                           extra=moe_statistics(result))
        # Each tensor-parallel rank of the last pipeline stage holds its data-parallel rank's loss
        # (each CP rank its share of it: their mean is the data-parallel rank's loss).
        loss, grad_norm = votes.loss_sum / job.dims.loss_ranks, float(result["grad_norm"])
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            saver.wait()
            raise JobFailed(ConfigError(
                f"step {step}: the loss is {loss} (gradient norm {grad_norm}): training diverged, and this "
                f"step was not saved. Lower optim.lr, check the model settings, and resume from the last "
                f"checkpoint in {job.cfg.checkpoint.folder} (or start over in a new output_dir)"),
                job.dims.world_size)
        step_time = time.perf_counter() - step_start
        record: Dict[str, Any] = {
            "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_step / step_time, "step_time_s": step_time,
            **job.throughput.record(step_time), **memory_record(platform),
            "world_size": job.dims.world_size, "mesh": job.dims.mesh_shape,
        }
        if job.loss_floor is not None:
            record["loss_floor"] = job.loss_floor
        if votes.extra:
            record.update(moe_record(votes.extra, job.dims.loss_ranks, job.cfg.model.moe.num_experts))
        reason = ("SIGTERM" if votes.sigterm else "time limit" if votes.out_of_time
                  else "stop_after_steps" if limits.steps_done(step) else None)
        # An agreed SIGTERM or time limit skips the evaluation: the save starts at this boundary.
        if reason in (None, "stop_after_steps") and job.evaluator is not None and job.evaluator.due(step, t.steps):
            record.update(job.evaluator.evaluate(job.model, cp=job.cp, loss_chunks=t.loss_chunks,
                                                 document_eos=document_eos))
            if count_ranks(stop.requested, job.device):  # a SIGTERM during the evaluation: save now, not a step later
                reason = "SIGTERM"
        if job.profiler is not None and (trace := job.profiler.after_step(step)):
            job.log.print(f"profiler: rank 0 trace {trace}")
        job.log.log_step(record, memory_bytes=record["memory_bytes"])
        summary.losses.append(loss)
        last = step == t.steps
        saver.save(step, operations.final_state(job.cfg.checkpoint, job.state) if last else job.state,
                   force=last or reason is not None)
        if job.snapshots is not None and not last and reason is None and job.snapshots.due(step):
            job.snapshots.take(step, job.state, busy_ranks=votes.snapshot_busy)
        if reason is not None:
            summary.stopped_by_signal, summary.stop_reason = reason == "SIGTERM", reason
            job.log.print(f"{reason}: saved a final checkpoint at step {step}, stopping")
            break
        if votes.bad_batch:
            saver.wait()
            raise JobFailed(error, votes.bad_batch)
    saver.wait()
    summary.end_step = step
    summary.wall_time_s = time.perf_counter() - started
    summary.tokens_per_s = tokens_per_step * (step - summary.start_step) / summary.wall_time_s
    return summary
