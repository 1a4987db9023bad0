"""The training loop shared by the recipes: setup from config, steps, checkpoints, summary."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from hyper_parallel.data import DistributedBatchLoader, build_source
from hyper_parallel.platform import Platform
from hyper_parallel.trainer.config import ConfigError, ParallelDims
from hyper_parallel.trainer.metrics import MetricsLogger
from hyper_parallel.trainer.parallelize import build_mesh, build_model
from hyper_parallel.trainer.schedule import WarmupCosineSchedule
from hyper_parallel.trainer.state import RNGState, StopRequest, all_reduce_sum, training_state


def build_loader(cfg: DictConfig, vocab_size: int, dp_rank: int, dp_size: int) -> DistributedBatchLoader:
    """The data loader of this rank, from the ``data`` and ``training`` config."""
    options = OmegaConf.to_container(cfg.data, resolve=True)
    kind, shuffle = options.pop("kind"), options.pop("shuffle", False)
    source = build_source(kind, seq_len=cfg.training.seq_len, vocab_size=vocab_size,
                          seed=cfg.training.seed, **options)
    return DistributedBatchLoader(source, cfg.training.global_batch_size, dp_rank=dp_rank,
                                  dp_size=dp_size, seed=cfg.training.seed, shuffle=shuffle)


def build_optimizer(model: nn.Module, optim_cfg: DictConfig) -> torch.optim.Optimizer:
    # foreach=False: the per-parameter path handles DTensor parameters on every mesh shape.
    return torch.optim.AdamW(model.parameters(), lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
                             eps=optim_cfg.eps, weight_decay=optim_cfg.weight_decay, foreach=False)


def _set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)


def train_step(model: nn.Module, batch: torch.Tensor, optimizer: torch.optim.Optimizer,
               *, grad_accum_steps: int, max_grad_norm: float) -> Dict[str, torch.Tensor]:
    """One optimizer step on this rank's slice of the global batch.

    ``batch`` is ``(local_batch, seq_len + 1)``; it is split into ``grad_accum_steps``
    micro-batches whose gradients accumulate locally, synchronised only on the last one.
    Returns 0-dim tensors (no host sync): this rank's mean ``loss`` and the global
    ``grad_norm`` before clipping.
    """
    import hyper_parallel as hp

    micro_batches = batch.chunk(grad_accum_steps)
    loss_sum = torch.zeros((), device=batch.device)
    for i, micro in enumerate(micro_batches):
        _set_gradient_sync(model, i == len(micro_batches) - 1)
        logits = model(micro[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), micro[:, 1:].flatten())
        (loss / grad_accum_steps).backward()
        loss_sum += loss.detach()
    clip = max_grad_norm if max_grad_norm > 0 else float("inf")
    grad_norm = hp.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss_sum / grad_accum_steps, "grad_norm": grad_norm}


@dataclass
class TrainingJob:
    """Everything a run needs, built from the config (see :func:`build_job`)."""

    cfg: DictConfig
    dims: ParallelDims
    platform: Platform
    device: torch.device
    mesh: DeviceMesh
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: WarmupCosineSchedule
    loader: DistributedBatchLoader
    manager: Any  # hyper_parallel.checkpoint.CheckpointManager
    state: Dict[str, Any]
    log: MetricsLogger
    loss_floor: Optional[float]


@dataclass
class RunSummary:
    """What a run did (returned to the recipe, printed on rank 0)."""

    start_step: int
    end_step: int
    losses: List[float] = field(default_factory=list)
    loss_floor: Optional[float] = None
    stopped_by_signal: bool = False
    wall_time_s: float = 0.0
    tokens_per_s: float = 0.0


def build_job(cfg: DictConfig, dims: ParallelDims, platform: Platform) -> TrainingJob:
    """Data, mesh, sharded model, optimizer, schedule, checkpoint manager and logger.

    Requires an initialised default process group of ``dims.dp_size`` ranks.

    Raises:
        ConfigError: the data or ``model.init_from`` cannot be read or do not fit the model
            (found identically on every rank).
    """
    from hyper_parallel.checkpoint import CheckpointManager

    t, rank = cfg.training, platform.rank
    device = platform.current_device() if t.device == "auto" else torch.device("cpu")
    torch.manual_seed(t.seed)
    try:
        loader = build_loader(cfg, cfg.model.vocab_size, dp_rank=rank, dp_size=dims.dp_size)
    except (ValueError, TypeError, FileNotFoundError) as err:
        raise ConfigError(f"data={cfg.data.kind}: {err}") from None
    mesh = build_mesh(dims, device.type)
    model = build_model(cfg.model, mesh=mesh, device=device, seed=t.seed,
                        mixed_precision=cfg.parallel.mixed_precision,
                        reshard_after_forward=cfg.parallel.reshard_after_forward,
                        compile_backend=t.compile_backend if t.compile else None)
    # Every rank starts training from the same global generator state (the checkpoint stores it).
    torch.manual_seed(t.seed + 1)
    optimizer = build_optimizer(model, cfg.optim)
    schedule = WarmupCosineSchedule(optimizer, peak_lr=cfg.optim.lr, warmup_steps=cfg.optim.warmup_steps,
                                    total_steps=t.steps, min_lr_ratio=cfg.optim.min_lr_ratio)
    manager = CheckpointManager(cfg.checkpoint.folder, interval=cfg.checkpoint.interval,
                                keep_last_n=cfg.checkpoint.keep_last_n, async_save=cfg.checkpoint.async_save)
    log = MetricsLogger(cfg.output_dir, total_steps=t.steps, is_main=rank == 0,
                        log_every=cfg.logging.log_every, tensorboard=cfg.logging.tensorboard)
    if rank == 0:
        OmegaConf.save(cfg, os.path.join(cfg.output_dir, "config.yaml"))
    return TrainingJob(
        cfg=cfg, dims=dims, platform=platform, device=device, mesh=mesh, model=model,
        optimizer=optimizer, schedule=schedule, loader=loader, manager=manager,
        state=training_state(model, optimizer, schedule, loader, RNGState(platform.device_module)),
        log=log, loss_floor=getattr(loader.source, "loss_floor", lambda: None)(),
    )


def describe(job: TrainingJob) -> str:
    """One line: model size, mesh, precision, data (and its loss floor)."""
    cfg, mesh = job.cfg, job.mesh
    mesh_desc = "x".join(map(str, mesh.shape)) + f" ({', '.join(mesh.mesh_dim_names)})"
    floor = f", loss floor {job.loss_floor:.4f}" if job.loss_floor is not None else ""
    return (f"model {cfg.model.name}: {sum(p.numel() for p in job.model.parameters()):,} parameters, "
            f"mesh {mesh_desc}, {cfg.parallel.mixed_precision}, data {cfg.data.kind}{floor}")


def run_training(cfg: DictConfig, dims: ParallelDims, platform: Platform) -> RunSummary:
    """Train as configured, resuming from ``checkpoint.folder`` when it holds a checkpoint.

    Raises:
        ConfigError: see :func:`build_job`.
    """
    job = build_job(cfg, dims, platform)
    step = (job.manager.load_latest(job.state) if cfg.checkpoint.resume else None) or 0
    job.log.print(describe(job))
    job.log.print(f"resumed from {cfg.checkpoint.folder}/step-{step}" if step else "starting from scratch")
    if step >= cfg.training.steps:
        job.log.print(f"the latest checkpoint is at step {step} >= training.steps={cfg.training.steps}: "
                      "nothing to train")
        job.log.close()
        return RunSummary(start_step=step, end_step=step, loss_floor=job.loss_floor)
    stop = StopRequest()
    if cfg.checkpoint.save_on_sigterm:
        stop.install()
    try:
        summary = train_loop(job, step, stop)
    finally:
        stop.uninstall()
    job.log.print(format_summary(summary, cfg))
    job.log.close()
    return summary


def train_loop(job: TrainingJob, step: int, stop: StopRequest) -> RunSummary:
    """Steps ``step+1 .. training.steps`` with metrics and checkpoints; stops early (after a
    final checkpoint) when any rank got SIGTERM.

    Raises:
        ConfigError: the data yields an invalid batch (e.g. a token id >= vocab_size).
    """
    t, platform = job.cfg.training, job.platform
    summary = RunSummary(start_step=step, end_step=step, loss_floor=job.loss_floor)
    tokens_per_step = t.global_batch_size * t.seq_len
    started = time.perf_counter()
    while step < t.steps:
        step_start = time.perf_counter()
        platform.reset_peak_memory()
        try:
            batch = job.loader.next_batch().to(job.device)
        except ValueError as err:  # e.g. a token id outside the vocabulary, deep in a data file
            raise ConfigError(f"data={job.cfg.data.kind}, step {step + 1}: {err}") from None
        lr = job.schedule.step()
        result = train_step(job.model, batch, job.optimizer, grad_accum_steps=t.grad_accum_steps,
                            max_grad_norm=t.max_grad_norm)
        step += 1
        # One collective per step: the global mean loss, and whether any rank got SIGTERM.
        flag = torch.tensor(stop.as_tensor_value, device=job.device)
        loss_sum, stop_votes = all_reduce_sum(torch.stack([result["loss"], flag])).tolist()
        loss = loss_sum / job.dims.dp_size
        step_time = time.perf_counter() - step_start
        record: Dict[str, Any] = {
            "step": step, "loss": loss, "lr": lr, "grad_norm": float(result["grad_norm"]),
            "tokens_per_s": tokens_per_step / step_time, "step_time_s": step_time,
            "memory_bytes": platform.peak_memory_bytes(),
        }
        if job.loss_floor is not None:
            record["loss_floor"] = job.loss_floor
        job.log.log_step(record, memory_bytes=record["memory_bytes"])
        summary.losses.append(loss)
        stopping = stop_votes > 0
        job.manager.save(step, job.state, force=step == t.steps or stopping)
        if stopping:
            summary.stopped_by_signal = True
            job.log.print(f"SIGTERM: saved a final checkpoint at step {step}, stopping")
            break
    job.manager.wait()
    summary.end_step = step
    summary.wall_time_s = time.perf_counter() - started
    summary.tokens_per_s = tokens_per_step * (step - summary.start_step) / summary.wall_time_s
    return summary


def format_summary(summary: RunSummary, cfg: DictConfig) -> str:
    """The end-of-run report printed on rank 0."""
    lines = [f"done: steps {summary.start_step} -> {summary.end_step} in {summary.wall_time_s:.1f}s "
             f"({summary.tokens_per_s:,.0f} tokens/s)"]
    if summary.losses:
        lines.append(f"loss {summary.losses[0]:.4f} -> {summary.losses[-1]:.4f}"
                     + (f" (best achievable {summary.loss_floor:.4f})" if summary.loss_floor is not None else ""))
    lines.append(f"metrics: {os.path.join(cfg.output_dir, 'metrics.jsonl')}")
    lines.append(f"checkpoints: {cfg.checkpoint.folder}")
    return "\n".join(lines)
