"""Rank-0 metrics: one JSON line per step, a live console line, optional TensorBoard / W&B sinks."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, TextIO

import torch

from hyper_parallel.models.moe import MoETransformer
from hyper_parallel.utils.fileio import open_regular
from hyper_parallel.trainer.observability.sinks import TENSORBOARD_FOLDER, MetricsSink, TensorBoardSink, WandbSettings, WandbSink
from hyper_parallel.utils.units import format_bytes

METRICS_FILE = "metrics.jsonl"  # in output_dir


def _format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class MetricsLogger:
    """Writes metrics on rank 0 only; every other rank's calls do nothing.

    Args:
        output_dir: ``metrics.jsonl`` (appended to) and ``tensorboard/`` go here.
        total_steps: for the ETA.
        is_main: whether this rank writes.
        log_every: console line every N steps (the JSON line is written every step).
        tensorboard: also write TensorBoard scalars to ``output_dir/tensorboard``.
        wandb: also log to a Weights & Biases run with these settings.

    Raises:
        SinkError: a sink cannot start (e.g. its package is not installed; the message says why).
        RefusedFileError: ``metrics.jsonl`` is a symbolic link or not a regular file.
        OSError: ``output_dir`` or ``metrics.jsonl`` cannot be written.
    """

    def __init__(self, output_dir: str, *, total_steps: int, is_main: bool, log_every: int = 1,
                 tensorboard: bool = False, wandb: Optional[WandbSettings] = None, stream: TextIO = sys.stdout):
        self.total_steps, self.is_main, self.log_every, self.stream = total_steps, is_main, log_every, stream
        self._sinks: List[MetricsSink] = []
        self._jsonl = None
        self._start: Optional[float] = None
        self._steps_timed = 0
        if not is_main:
            return
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, METRICS_FILE)
        # Appended to, never through a symbolic link or into another file's hard link.
        self._jsonl = os.fdopen(open_regular(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a", encoding="utf-8")
        try:
            if tensorboard:
                self._sinks.append(TensorBoardSink(os.path.join(output_dir, TENSORBOARD_FOLDER)))
            if wandb is not None:
                self._sinks.append(WandbSink(output_dir, wandb))
        except BaseException:
            self.close()
            raise

    def print(self, message: str) -> None:
        if self.is_main:
            print(message, file=self.stream, flush=True)

    def log_step(self, record: Dict[str, Any], *, memory_bytes: Optional[int] = None) -> None:
        """Record one optimizer step (``record`` holds at least step, loss, lr, tokens_per_s)."""
        if not self.is_main:
            return
        now = time.perf_counter()
        if self._start is None:
            self._start = now - record.get("step_time_s", 0.0)
        self._steps_timed += 1
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._sinks:
            scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
            for sink in self._sinks:
                sink.log(scalars, record["step"])
        step = record["step"]
        if step % self.log_every == 0 or step == self.total_steps or self._steps_timed == 1:
            eta = (now - self._start) / self._steps_timed * (self.total_steps - step)
            parts = [f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}",
                     f"loss {record['loss']:.4f}"]
            if "loss_floor" in record:
                parts.append(f"(floor {record['loss_floor']:.4f})")
            if "aux_loss" in record:
                parts.append(f"aux {record['aux_loss']:.4f}  expert load {record['expert_load']:.2f}")
            parts += [f"lr {record['lr']:.2e}", f"grad_norm {record.get('grad_norm', float('nan')):.3f}",
                      f"{record['tokens_per_s']:,.0f} tok/s"]
            if "tflops" in record:
                parts.append(f"{record['tflops']:.3g} TFLOP/s"
                             + (f" (MFU {record['mfu']:.1%})" if record.get("mfu") is not None else ""))
            if memory_bytes is not None:
                parts.append(f"mem {format_bytes(memory_bytes)}")
            parts.append(f"eta {_format_duration(eta)}")
            self.print("  ".join(parts))
        if "val_loss" in record:
            self.print(f"eval step {step}: val_loss {record['val_loss']:.4f}  val_ppl {record['val_ppl']:.2f}")

    def log_event(self, record: Dict[str, Any]) -> None:
        """Record something that is not a step (``record`` holds ``"event"``, e.g. a recovery)."""
        if self.is_main:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        for sink in self._sinks:
            sink.close()
        self._sinks = []


class MoEStepStatistics:
    """A mixture of experts' statistics of one step on this rank, summed over its micro-batch
    forwards (call :meth:`add` after each): the ``aux_loss`` (weighted, as
    :meth:`~hyper_parallel.models.moe.MoETransformer.aux_loss`) and the ``(token, expert)``
    pairs each expert got, one row per MoE block of the whole model (``blocks``: their names in
    order). A pipeline stage fills only its own blocks' rows and adds only its own blocks' aux
    loss, so that the sum over the stages' ranks (:func:`moe_statistics`) covers the model."""

    def __init__(self, blocks: Sequence[str], num_experts: int, device: torch.device):
        self._rows = {name: row for row, name in enumerate(blocks)}
        self._num_experts, self._device = num_experts, device
        self.reset()

    def reset(self) -> None:
        """Start a step: nothing counted."""
        self._aux = torch.zeros((), device=self._device)
        self._tokens = torch.zeros(len(self._rows), self._num_experts, device=self._device)

    def add(self, model: MoETransformer) -> None:
        """Count ``model``'s last forward (the whole model, or a pipeline stage of it)."""
        self._aux = self._aux + model.aux_loss().to(self._aux.dtype)
        for name, counts in model.tokens_per_expert().items():
            self._tokens[self._rows[name]] += counts.to(self._tokens.dtype)

    def result(self, micro_batches: int) -> Dict[str, torch.Tensor]:
        """``aux_loss``: the sum divided by the step's ``micro_batches`` (its mean per forward of
        the whole batch); ``expert_tokens``: ``[blocks, num_experts]`` float counts."""
        return {"aux_loss": self._aux / micro_batches, "expert_tokens": self._tokens.clone()}


def moe_statistics(result: Dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
    """A mixture of experts' step statistics for :func:`~hyper_parallel.trainer.step.agreement.step_votes`
    to sum over the ranks: the ``aux_loss`` then every block's ``expert_tokens`` (None for a
    dense model)."""
    if "aux_loss" not in result:
        return None
    return torch.cat([result["aux_loss"].reshape(1).float(), result["expert_tokens"].flatten()])


def moe_record(summed: Sequence[float], loss_ranks: int, num_experts: int) -> Dict[str, Any]:
    """The metrics of :func:`moe_statistics` summed over every rank (with pipeline stages each
    rank reports its own stages' blocks), of ``loss_ranks`` data-parallel ranks: ``aux_loss``
    (their mean) and the expert load balance, max / mean over the ``num_experts`` experts of
    the tokens each got in the step's global batch, per MoE block (``expert_load_per_block``;
    1.0: balanced, ``num_experts / top_k`` at worst) and the worst block's (``expert_load``).
    Empty for a dense model."""
    if not summed:
        return {}
    counts = torch.tensor(summed[1:], dtype=torch.float64).view(-1, num_experts)
    load = (counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-12)).tolist()
    return {"aux_loss": summed[0] / loss_ranks, "expert_load": max(load), "expert_load_per_block": load}
