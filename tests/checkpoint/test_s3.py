"""Checkpoints on a real S3 endpoint: moto's server on 127.0.0.1 (``s3_server.py``), reached
through s3fs with the standard AWS_* variables: save and resharding load on 2 ranks, async
save, CheckpointManager retention."""

from __future__ import annotations

import os

import pytest

from hyper_parallel import checkpoint as hdcp
from tests.checkpoint.helpers import blank_state, distribute_state, full_state, load_and_check, save_layout
from tests.checkpoint.s3_server import with_env
from tests.multirank import run_on_ranks

T = 120


def _env(s3):
    return {k: v for k, v in s3.items() if k != "url"}


def _objects(url):
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.find(url[len("s3://"):]))


def test_save_and_resharding_load_on_two_ranks(s3_bucket):
    url = f"{s3_bucket['url']}/run/step-1"
    env = _env(s3_bucket)
    run_on_ranks(2, with_env, env, save_layout, url, "fsdp", timeout=T)
    assert "metadata.json" in _objects(url)
    assert all(run_on_ranks(2, with_env, env, load_and_check, url, ["shard1", "replicate"], timeout=T))
    assert load_and_check(url, [None], no_dist=True)
    assert hdcp.verify_checkpoint(url).world_size == 2


def _async_save(url):
    future = hdcp.async_save(distribute_state(full_state(), "fsdp"), checkpoint_id=url)
    return future.result(timeout=60).save_id is not None


def test_async_save_on_two_ranks(s3_bucket):
    url = f"{s3_bucket['url']}/run/step-2"
    env = _env(s3_bucket)
    assert all(run_on_ranks(2, with_env, env, _async_save, url, timeout=T))
    assert not [n for n in _objects(url) if n.startswith(".")]  # markers removed at commit
    assert load_and_check(url, [None], no_dist=True)


def test_manager_retention(s3_bucket):
    folder = f"{s3_bucket['url']}/run"
    manager = hdcp.CheckpointManager(folder, keep_last_n=2, async_save=True)
    for step in (1, 2, 3):
        manager.save(step, full_state(seed=step))
    manager.wait()
    assert manager.committed_steps() == [2, 3]
    assert not [n for n in _objects(folder) if "step-1" in n]
    target = blank_state()
    assert manager.load_latest(target) == 3
    assert load_and_check(manager.checkpoint_path(3), [None], seed=3, no_dist=True)
    manager.close()


def test_large_object_is_a_multipart_upload(s3_bucket, monkeypatch):
    import torch

    from hyper_parallel.core.distributed_checkpoint.object_store import writer

    monkeypatch.setattr(writer, "UPLOAD_PART_BYTES", 5 << 20)  # S3's smallest part
    url = f"{s3_bucket['url']}/big"
    state = {"w": torch.arange(3 << 20, dtype=torch.float32)}  # 12 MiB: 3 parts
    hdcp.save(state, checkpoint_id=url, no_dist=True)
    target = {"w": torch.zeros_like(state["w"])}
    hdcp.load(target, checkpoint_id=url, no_dist=True)
    assert torch.equal(target["w"], state["w"])


pytestmark = pytest.mark.timeout(300)


_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_KILLED_SAVE = """
import sys, time, torch
from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.object_store import writer

def stall(*args, **kwargs):  # the tensor object is uploaded; the values object comes next
    print("uploaded", flush=True)
    time.sleep(600)

writer.encode_values = stall
hdcp.save({"w": torch.ones(1000), "step": 2}, checkpoint_id=sys.argv[1], no_dist=True)
"""


def test_kill_9_during_a_save_leaves_no_checkpoint(s3_bucket):
    import signal
    import subprocess
    import sys

    folder = f"{s3_bucket['url']}/run"
    manager = hdcp.CheckpointManager(folder)
    manager.save(1, full_state(seed=1))
    manager.close()
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, f"{folder}/step-2"], stdout=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=_REPO))
    try:
        assert proc.stdout.readline().strip() == b"uploaded"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert any(n.endswith(".safetensors") for n in _objects(f"{folder}/step-2"))  # the upload it left
    assert not hdcp.is_checkpoint(f"{folder}/step-2")
    resumed = hdcp.CheckpointManager(folder)  # removes the killed save's objects
    assert _objects(f"{folder}/step-2") == []
    assert resumed.committed_steps() == [1]
    target = blank_state()
    assert resumed.load_latest(target) == 1
    resumed.close()


def test_cli_inspect_verify_list_on_an_s3_folder(s3_bucket, capsys):
    import subprocess
    import sys

    from hyper_parallel.core.distributed_checkpoint.cli import main

    folder = f"{s3_bucket['url']}/run"
    manager = hdcp.CheckpointManager(folder)
    for step in (1, 2):
        manager.save(step, full_state(seed=step))
    manager.close()
    fs_url = f"{folder}/step-9/__0_0.{'ab' * 16}.safetensors"  # an uncommitted upload: never chosen
    import fsspec
    with fsspec.open(fs_url, "wb") as f:
        f.write(b"partial")
    newest = f"{folder}/step-2"
    assert main(["list", folder]) == 0
    assert capsys.readouterr().out.split() == ["step-1", "step-2"]
    assert main(["inspect", folder]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint: {newest} (the newest committed step in {folder})" in out and "step: 2" in out
    # The subprocess reads AWS_ENDPOINT_URL and the credentials from its environment, as botocore does.
    result = subprocess.run([sys.executable, "-m", "hyper_parallel.checkpoint", "verify", folder],
                            env=dict(os.environ, PYTHONPATH=_REPO), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith(f"OK: {newest} (the newest committed step"), result.stderr
    assert main(["verify", f"{folder}/step-9"]) == 1
    assert "is not a committed checkpoint (metadata.json is missing)" in capsys.readouterr().err
