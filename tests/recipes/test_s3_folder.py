"""The recipe with ``checkpoint.folder`` on S3 (moto's server on 127.0.0.1, ``tests/checkpoint/
s3_server.py``): stopped and resumed from the bucket, it continues the uninterrupted run's losses;
``--check`` accepts such a URL and names a bucket it cannot write in one line."""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.checkpoint import CheckpointManager
from hyper_parallel.core.distributed_checkpoint.object_store.lease import LOCK_OBJECT
from hyper_parallel.platform import get_platform
from hyper_parallel.trainer import compose_config, run_training, validate_config
from tests.checkpoint.s3_server import with_env
from tests.multirank import run_on_ranks
from tests.recipes.launch import TINY, assert_losses_match, last_loss_per_step
from tests.recipes.train_in_process import one_line_error

pytestmark = pytest.mark.timeout(300)
STEPS = ["training.steps=6", "checkpoint.interval=2", "checkpoint.keep_last_n=1", "eval.every=0"]


def _train(overrides: List[str]) -> tuple:
    cfg = compose_config([*TINY, *STEPS, *overrides])
    summary = run_training(validate_config(cfg, dist.get_world_size()), get_platform())
    return summary.start_step, summary.end_step


def _lock_exists(folder: str) -> bool:
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    return fs.exists(f"{folder[len('s3://'):]}/{LOCK_OBJECT}")


def _env(s3: Dict[str, str]) -> Dict[str, str]:
    return {k: v for k, v in s3.items() if k != "url"}


def test_stopped_and_resumed_from_s3_continues_the_uninterrupted_losses(s3_bucket, tmp_path):
    env, folder = _env(s3_bucket), f"{s3_bucket['url']}/run"
    ref, out = str(tmp_path / "ref"), str(tmp_path / "out")
    run_on_ranks(2, _train, [f"output_dir={ref}"], timeout=240)
    s3 = [f"output_dir={out}", f"checkpoint.folder={folder}", "checkpoint.async_save=true"]
    assert run_on_ranks(2, with_env, env, _train, [*s3, "training.stop_after_steps=3"], timeout=240) == [(0, 3)] * 2
    # The run released the folder's lease (the recipe ends with os._exit: no interpreter exit
    # handlers), so the next job starts at once instead of waiting for the lease to run out.
    assert not _lock_exists(folder)
    assert CheckpointManager(folder).committed_steps() == [3]  # step 2 retired, 3 saved at the stop
    assert run_on_ranks(2, with_env, env, _train, s3, timeout=240) == [(3, 6)] * 2
    losses = last_loss_per_step(out)
    assert sorted(losses) == list(range(1, 7))
    assert_losses_match(last_loss_per_step(ref), losses)
    # checkpoint.load_from on a URL: a new run continues from that bucket's step-6.
    other = str(tmp_path / "other")
    assert run_on_ranks(2, with_env, env, _train, [f"output_dir={other}", "training.steps=7",
                                                   f"checkpoint.load_from={folder}"], timeout=240) == [(6, 7)] * 2


def test_check_accepts_an_s3_folder_and_names_a_missing_bucket(check, s3_bucket, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = check(f"checkpoint.folder={s3_bucket['url']}/run")
    assert code == 0, err
    assert not (tmp_path / "s3:").exists()
    code, _, err = check("checkpoint.folder=s3://no-such-bucket/run")
    one_line_error(code, err, "checkpoint.folder=s3://no-such-bucket/run cannot be written")
    # checkpoint.resume=false on a folder holding another run's checkpoints is refused, as for a directory.
    manager = CheckpointManager(f"{s3_bucket['url']}/run")
    manager.save(5, {"w": torch.ones(2)})
    manager.close()
    code, _, err = check(f"checkpoint.folder={s3_bucket['url']}/run", "checkpoint.resume=false")
    one_line_error(code, err, f"checkpoint.folder={s3_bucket['url']}/run holds checkpoints of an earlier run (step-5)")


@pytest.mark.parametrize("source, expected", [
    ("s3://AKIAEXAMPLE:SECRETKEY@bucket/run", "holds credentials"),
    ("s3://AKIAEXAMPLE%3ASECRETKEY%40bucket/run", "holds credentials"),
    ("' s3://bucket/run'", "has leading or trailing whitespace"),
    ("simplecache::s3://bucket/run", "chains file systems"),
])
def test_check_refuses_a_load_from_the_stores_refuse_in_one_line(check, tmp_path, monkeypatch, source, expected):
    """``--check`` reads ``checkpoint.load_from`` too: its refused forms are one line before
    the run, not a traceback after start-up."""
    monkeypatch.chdir(tmp_path)
    code, _, err = check(f"checkpoint.folder={tmp_path / 'ck'}", f"checkpoint.load_from={source}")
    one_line_error(code, err, "checkpoint.load_from: ")
    assert expected in err and "SECRETKEY" not in err, err
