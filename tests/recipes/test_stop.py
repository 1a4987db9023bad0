"""A SIGTERM is saved at the first step boundary after it, on 2 gloo ranks in-process: the
evaluation of the stopping step is skipped, and a signal during an evaluation is not carried
into one more step."""

from __future__ import annotations

import json
import os
import signal

import torch.distributed as dist

from hyper_parallel.checkpoint import CheckpointManager
from hyper_parallel.platform import get_platform
from hyper_parallel.trainer import compose_config, loop, run_training, validate_config
from hyper_parallel.trainer.evaluation import Evaluator
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
        summary = run_training(cfg, validate_config(cfg, dist.get_world_size()), get_platform())
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
