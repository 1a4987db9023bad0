"""Rank-0 metrics: JSON lines, console progress, and nothing from other ranks."""

import io
import json
import os
import sys

import pytest

from hyper_parallel.trainer.observability.metrics import MetricsLogger


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


def _wandb_records(output_dir):
    """The records of the offline W&B run in ``output_dir/wandb`` (its leveldb-style log file:
    a 7-byte header, then 32 KiB blocks of records with 7-byte headers)."""
    import glob
    import struct

    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(str(output_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, block, pos, pending, records = open(path, "rb").read(), 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_wandb_offline_run_records_every_step(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    from hyper_parallel.trainer.observability.sinks import WANDB_RUN_ID_FILE, WandbSettings

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    settings = WandbSettings(project="proj", run_name="tiny", config={"training": {"steps": 3}})
    log = MetricsLogger(str(out), total_steps=3, is_main=True, wandb=settings, stream=io.StringIO())
    for step in range(1, 4):
        log.log_step({**_record(step), "mfu": None})  # None (no peak on CPU) is left out
    log.close()
    wandb.teardown()  # the W&B service writes the run file in the background: wait for it
    records = _wandb_records(out)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "proj" and run.display_name == "tiny"
    assert run.run_id == (out / WANDB_RUN_ID_FILE).read_text().strip()  # a resumed job reuses it
    assert json.loads({u.key: u.value_json for u in run.config.update}["training"]) == {"steps": 3}
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], h["loss"]) for h in history] == [(s, pytest.approx(2.0 / s)) for s in range(1, 4)]
    assert {"lr", "tokens_per_s", "grad_norm", "loss_floor"} <= set(history[0]) and "mfu" not in history[0]


def test_wandb_without_the_package_is_one_line_naming_the_extra(tmp_path, monkeypatch):
    from hyper_parallel.trainer import compose_config, validate_config
    from hyper_parallel.trainer.launch import preflight
    from hyper_parallel.trainer.config import ConfigError
    from hyper_parallel.trainer.observability.sinks import WandbSettings

    monkeypatch.setitem(sys.modules, "wandb", None)  # makes the import fail
    with pytest.raises(RuntimeError, match=r"needs the 'wandb' package: pip install 'hyper_parallel\[wandb\]'"):
        MetricsLogger(str(tmp_path), total_steps=1, is_main=True, wandb=WandbSettings(project="p"))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "wandb" else object())
    config = validate_config(compose_config(["logging.wandb=true", f"output_dir={tmp_path / 'out'}"]), 1)
    with pytest.raises(ConfigError) as err:
        preflight.check_environment(config.cfg, config.dims, ranks_per_node=1)
    assert str(err.value) == ("logging.wandb=true needs the 'wandb' package: pip install 'hyper_parallel[wandb]', "
                              "or set logging.wandb=false")


def test_the_logging_keys_make_the_wandb_settings():
    from hyper_parallel.trainer import compose_config
    from hyper_parallel.trainer.observability.sinks import wandb_settings

    assert wandb_settings(compose_config([])) is None
    settings = wandb_settings(compose_config(["logging.wandb=true", "logging.wandb_project=p",
                                              "logging.wandb_run_name=r", "training.steps=7"]))
    assert (settings.project, settings.run_name, settings.config["training"]["steps"]) == ("p", "r", 7)


def test_metrics_jsonl_is_never_written_through_a_symlink(tmp_path):
    from hyper_parallel.utils.fileio import RefusedFileError

    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "out").mkdir()
    os.symlink(victim, tmp_path / "out" / "metrics.jsonl")
    with pytest.raises(RefusedFileError, match="metrics.jsonl is a symbolic link"):
        MetricsLogger(str(tmp_path / "out"), total_steps=1, is_main=True)
    assert victim.read_text() == "precious"


def _train_two_steps(output_dir):
    import torch.distributed as dist

    from hyper_parallel.platform import get_platform
    from hyper_parallel.trainer import compose_config, run_training, validate_config
    from tests.recipes.launch import TINY

    cfg = compose_config([*TINY, "training.steps=2", f"output_dir={output_dir}"])
    run_training(validate_config(cfg, dist.get_world_size()), get_platform())


def test_every_record_says_the_world_size_and_the_mesh(tmp_path):
    from tests.multirank import run_on_ranks
    from tests.recipes.script_main import script_module

    run_on_ranks(2, _train_two_steps, str(tmp_path), timeout=120)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["world_size"], r["mesh"]) for r in records] == [(1, 2, {"shard": 2}), (2, 2, {"shard": 2})]
    run = script_module("plot_metrics").read_run(str(tmp_path))  # its reader takes the new fields
    assert [r["step"] for r in run.records] == [1, 2] and run.world_changes == []
