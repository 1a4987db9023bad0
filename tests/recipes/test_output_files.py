"""The files and folders the recipe writes into ``output_dir`` and ``checkpoint.folder``: a
symbolic link, a file where a folder belongs, a read-only folder or a junk W&B run id is one
line and exit 2 from the start-up checks (``recipes/train.py --check`` in-process), and one line
from the rank that meets it if it appears after the checks."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

from hyper_parallel.checkpoint import LOCK_FILE
from hyper_parallel.platform import get_platform
from hyper_parallel.trainer import compose_config, run_training, validate_config
from hyper_parallel.trainer.step.agreement import JobFailed
from hyper_parallel.trainer.observability.sinks import WANDB_RUN_ID_FILE, SinkError, WandbSettings, WandbSink, read_wandb_run_id
from tests.multirank import run_on_ranks
from tests.recipes.launch import TINY
from tests.recipes.train_in_process import one_line_error


@pytest.fixture
def out(tmp_path):
    """``output_dir`` of the ``check`` fixture, made, with a victim file beside it."""
    (tmp_path / "out" / "checkpoints").mkdir(parents=True)
    (tmp_path / "victim").write_text("precious")
    return tmp_path / "out"


def test_a_symlinked_metrics_file_or_lock_file_is_one_line(check, out, tmp_path):
    os.symlink(tmp_path / "victim", out / "metrics.jsonl")
    one_line_error(*check()[::2], f"output_dir: {out}/metrics.jsonl is a symbolic link, not a regular file; "
                                  "refusing to use it; remove it or choose another output_dir")
    os.unlink(out / "metrics.jsonl")
    os.symlink(tmp_path / "victim", out / "checkpoints" / LOCK_FILE)
    one_line_error(*check()[::2], f"checkpoint.folder: {out}/checkpoints/{LOCK_FILE} is a symbolic link")
    assert (tmp_path / "victim").read_text() == "precious"


def test_a_file_where_the_tensorboard_or_wandb_folder_belongs_is_one_line(check, out):
    for sink in ("tensorboard", "wandb"):
        (out / sink).write_text("x")
        one_line_error(*check(f"logging.{sink}=true")[::2],
                       f"logging.{sink}=true: {out}/{sink} cannot be used: {out}/{sink} is a file, not a folder")
        assert check()[0] == 0  # only where the sink is on


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_wandb_folder_is_one_line(check, out):
    (out / "wandb").mkdir(mode=0o500)
    one_line_error(*check("logging.wandb=true")[::2],
                   f"logging.wandb=true: {out}/wandb cannot be used: Permission denied")


@pytest.mark.parametrize("content, held", [
    ("abc/../../x\n", "'abc/../../x'"), ("", "''"), ("a" * 65, repr("a" * 40)), ("two ids\n", "'two ids'"),
    ("x" * 10_000, "over 256 bytes"),
])
def test_a_junk_wandb_run_id_is_one_line(check, out, content, held):
    (out / WANDB_RUN_ID_FILE).write_text(content)
    one_line_error(*check("logging.wandb=true")[::2],
                   f"logging.wandb=true: {out}/{WANDB_RUN_ID_FILE} does not hold a W&B run id (1 to 64 letters, "
                   f"digits, - or _; it holds {held}): delete it to start a new W&B run")


def test_the_wandb_run_id_is_never_read_through_a_symlink(check, out, tmp_path):
    (tmp_path / "victim").write_text("looksvalid\n")  # a valid id: only the link itself is wrong
    os.symlink(tmp_path / "victim", out / WANDB_RUN_ID_FILE)
    one_line_error(*check("logging.wandb=true")[::2],
                   f"{out}/{WANDB_RUN_ID_FILE} is a symbolic link, not a regular file; refusing to use it; delete it")
    with pytest.raises(SinkError, match="is a symbolic link"):
        read_wandb_run_id(str(out))
    with pytest.raises(SinkError, match="is a symbolic link"):  # the sink refuses before wandb.init
        WandbSink(str(out), WandbSettings(project="p"))
    os.unlink(out / WANDB_RUN_ID_FILE)
    assert read_wandb_run_id(str(out)) is None
    (out / WANDB_RUN_ID_FILE).write_text("  run-ID_7\n")
    assert read_wandb_run_id(str(out)) == "run-ID_7"


def _train(overrides):
    """The recipe's training on this rank without the start-up checks: its report line if it failed."""
    cfg = compose_config([*TINY, *overrides])
    try:
        run_training(validate_config(cfg, dist.get_world_size()), get_platform())
    except JobFailed as failure:
        return failure.report(dist.get_rank(), dist.get_world_size())
    return "ok"


def test_a_symlink_that_appears_after_the_checks_is_one_line_from_the_rank_that_meets_it(out, tmp_path):
    os.symlink(tmp_path / "victim", out / "checkpoints" / LOCK_FILE)  # every rank learns of rank 0's refusal
    reports = run_on_ranks(2, _train, [f"output_dir={out}"], timeout=120)
    assert reports[1] is None and reports[0].startswith(f"cannot lock {out}/checkpoints: ") and "\n" not in reports[0]
    assert f"{LOCK_FILE} is a symbolic link" in reports[0]
    os.unlink(out / "checkpoints" / LOCK_FILE)
    os.symlink(tmp_path / "victim", out / "metrics.jsonl")  # rank 0 alone writes metrics.jsonl
    reports = run_on_ranks(2, _train, [f"output_dir={out}"], timeout=120)
    assert reports == [f"(rank 0 of 2) {out}/metrics.jsonl is a symbolic link, not a regular file; refusing to use it",
                       None]
    assert (tmp_path / "victim").read_text() == "precious"
