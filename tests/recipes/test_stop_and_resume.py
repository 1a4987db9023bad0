"""Stopping and resuming on 2 gloo ranks in-process. A SIGTERM is saved at the first step
boundary after it: the evaluation of the stopping step is skipped, and a signal during an
evaluation is not carried into one more step. A resumed run takes its optimizer
hyper-parameters from the config, not the checkpoint, and says so."""

from __future__ import annotations

import json
import os
import signal

import torch.distributed as dist

from hyper_parallel.checkpoint import CheckpointManager
from hyper_parallel.platform import get_platform
from hyper_parallel.trainer import compose_config, loop, run_training, validate_config
from hyper_parallel.trainer.step.evaluation import Evaluator
from tests.multirank import run_on_ranks
from tests.recipes.launch import TINY


def _train_signalled(overrides, rank, at_step, during):
    """Train, sending SIGTERM to ``rank`` itself during ``during`` ("step" or "eval") of step
    ``at_step``; the (start, end) steps of the run."""
    patched = {"step": (loop, "train_step"), "eval": (Evaluator, "evaluate")}[during]
    original = getattr(*patched)
    calls = []

    def signalled(*args, **kwargs):
        calls.append(None)
        if dist.get_rank() == rank and len(calls) == (at_step if during == "step" else 1):
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    setattr(*patched, signalled)
    try:
        cfg = compose_config([*TINY, *overrides])
        summary = run_training(validate_config(cfg, dist.get_world_size()), get_platform())
    finally:
        setattr(*patched, original)
    return summary.start_step, summary.end_step, summary.stop_reason


def _metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def test_sigterm_during_a_step_skips_its_evaluation_and_saves_it(tmp_path):
    out = str(tmp_path / "out")
    results = run_on_ranks(2, _train_signalled, [f"output_dir={out}", "eval.every=2", "eval.steps=1"],
                           1, 4, "step", timeout=120)
    assert results == [(0, 4, "SIGTERM")] * 2
    records = _metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert "val_loss" in records[1] and "val_loss" not in records[3]  # step 4's evaluation was skipped
    assert CheckpointManager(os.path.join(out, "checkpoints")).committed_steps() == [4]


def test_sigterm_during_an_evaluation_saves_that_step_without_another(tmp_path):
    out = str(tmp_path / "out")
    results = run_on_ranks(2, _train_signalled, [f"output_dir={out}", "eval.every=2", "eval.steps=1"],
                           0, 2, "eval", timeout=120)
    assert results == [(0, 2, "SIGTERM")] * 2
    assert [r["step"] for r in _metrics(out)] == [1, 2]
    assert CheckpointManager(os.path.join(out, "checkpoints")).committed_steps() == [2]


def _resume_with(overrides):
    """Train; the optimizer's betas at the end and the lines rank 0 printed."""
    from hyper_parallel.trainer.observability.metrics import MetricsLogger

    made, printed = [], []
    build, log_print = loop.build_optimizer, MetricsLogger.print
    loop.build_optimizer = lambda model, optim_cfg: made.append(build(model, optim_cfg)) or made[-1]
    MetricsLogger.print = lambda self, message: printed.append(message) if self.is_main else None
    try:
        cfg = compose_config([*TINY, *overrides])
        run_training(validate_config(cfg, dist.get_world_size()), get_platform())
    finally:
        loop.build_optimizer, MetricsLogger.print = build, log_print
    return made[0].param_groups[0]["betas"], printed


def test_a_resumed_run_uses_the_configs_betas_and_says_so(tmp_path):
    out = f"output_dir={tmp_path}"
    run_on_ranks(2, _resume_with, [out, "training.steps=2", "optim.betas=[0.9,0.95]"], timeout=120)
    results = run_on_ranks(2, _resume_with, [out, "training.steps=3", "optim.betas=[0.8,0.99]"], timeout=120)
    assert [betas for betas, _ in results] == [(0.8, 0.99)] * 2
    line = ("optim.betas: the config's [0.8, 0.99] replaces the checkpoint's [0.9, 0.95] "
            "(on resume the config wins for optimizer hyper-parameters)")
    assert line in results[0][1] and results[1][1] == []
    results = run_on_ranks(2, _resume_with, [out, "training.steps=4", "optim.betas=[0.8,0.99]"], timeout=120)
    assert results[0][0] == (0.8, 0.99) and not any("optim." in message for message in results[0][1])
