"""Rank-0 metrics: JSON lines, console progress, and nothing from other ranks."""

import io
import json
import sys

import pytest

from hyper_parallel.trainer.metrics import MetricsLogger


def _record(step):
    return {"step": step, "loss": 2.0 / step, "lr": 1e-3, "tokens_per_s": 1000.0, "grad_norm": 0.5,
            "loss_floor": 0.25, "step_time_s": 0.1}


def test_rank_zero_writes_every_step_and_prints_every_nth(tmp_path):
    console = io.StringIO()
    log = MetricsLogger(str(tmp_path), total_steps=10, is_main=True, log_every=5, stream=console)
    for step in range(1, 11):
        log.log_step(_record(step), memory_bytes=3 * 2**20)
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 11))
    printed = console.getvalue().splitlines()
    assert [line.split()[1] for line in printed] == ["1/10", "5/10", "10/10"]
    assert "loss 0.2000  (floor 0.2500)" in printed[-1] and "mem 3MiB" in printed[-1] and "eta 0:00" in printed[-1]


def test_other_ranks_write_nothing(tmp_path):
    console = io.StringIO()
    log = MetricsLogger(str(tmp_path / "out"), total_steps=3, is_main=False, stream=console)
    log.log_step(_record(1))
    log.print("hello")
    log.close()
    assert console.getvalue() == "" and not (tmp_path / "out").exists()


def test_tensorboard_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    with pytest.raises(RuntimeError, match="needs the 'tensorboard' package"):
        MetricsLogger(str(tmp_path), total_steps=1, is_main=True, tensorboard=True)


def test_tensorboard_scalars_are_written(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(str(tmp_path), total_steps=3, is_main=True, tensorboard=True, stream=io.StringIO())
    for step in range(1, 4):
        log.log_step(_record(step))
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("loss")]
    assert losses == [(step, pytest.approx(2.0 / step)) for step in range(1, 4)]
    assert {"lr", "tokens_per_s", "grad_norm"} <= set(events.Tags()["scalars"])
