"""On moto's S3 server (``s3_server.py``): one job per folder through the lease object (two
managers in two processes; conditional creates), and incomplete multipart uploads: aborted
when a manager starts and after each commit, also those of a save killed with ``kill -9``
in the middle of its multipart upload."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.object_store import lease
from hyper_parallel.core.distributed_checkpoint.object_store.conditional import object_ops
from tests.checkpoint.helpers import blank_state, full_state, load_and_check

pytestmark = pytest.mark.timeout(300)
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SAVE_ID = "ab" * 16


def _fs():
    import s3fs

    return s3fs.S3FileSystem()


def _uploads(url):
    fs = _fs()
    bucket, key, _ = fs.split_path(url)
    page = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
    return sorted(u["Key"] for u in page.get("Uploads", []) or [])


def _start_upload(url):
    fs = _fs()
    bucket, key, _ = fs.split_path(url)
    fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)


def _python(code, *args):
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=_REPO))


def test_conditional_create_and_replace_are_single_requests(s3_bucket):
    fs = _fs()
    ops = object_ops(fs)
    assert ops.atomic
    path = f"{s3_bucket['url'][len('s3://'):]}/lock"
    first = ops.create(path, b"one")
    assert first is not None and ops.create(path, b"two") is None  # If-None-Match: *
    assert fs.cat_file(path) == b"one"
    second = ops.replace(path, b"three", first)
    assert second is not None and ops.replace(path, b"four", first) is None  # If-Match: a stale ETag
    assert fs.cat_file(path) == b"three"
    assert not ops.delete(path, first) and ops.delete(path, second)


_SECOND_JOB = """
import sys
from hyper_parallel import checkpoint as hdcp
try:
    hdcp.CheckpointManager(sys.argv[1]).close()
except hdcp.CheckpointError as exc:
    print(exc)
    sys.exit(3)
"""


def test_two_managers_on_one_s3_folder(s3_bucket, monkeypatch):
    monkeypatch.setattr(lease, "LEASE_S", 2.0)
    folder = f"{s3_bucket['url']}/run"
    first = hdcp.CheckpointManager(folder)
    first.save(1, full_state(seed=1))
    proc = _python(_SECOND_JOB, folder)  # another job: sees the lease renewed, is refused
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert f"{folder} is in use by another job (pid {os.getpid()} on " in out.decode()
    first.close()  # releases: the next job starts at once
    assert not _fs().exists(f"{folder[len('s3://'):]}/{lease.LOCK_OBJECT}")
    started = time.monotonic()
    second = hdcp.CheckpointManager(folder)
    assert time.monotonic() - started < 1.0 and second.committed_steps() == [1]
    second.close()


_KILLED_MULTIPART = """
import sys, time, torch
import s3fs
from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.object_store import lease, writer

lease.LEASE_S = 2.0
writer.UPLOAD_PART_BYTES = 5 << 20  # S3's smallest part: 12 MiB go up in 3 parts
original = s3fs.core.S3File._upload_chunk

def stall(self, final=False):
    done = original(self, final)
    if self.parts:  # a part of the multipart upload is stored; the upload is not complete
        print("part", flush=True)
        time.sleep(600)
    return done

s3fs.core.S3File._upload_chunk = stall
manager = hdcp.CheckpointManager(sys.argv[1])
manager.save(2, {"w": torch.arange(3 << 20, dtype=torch.float32)})
"""


def test_kill_9_during_a_multipart_upload(s3_bucket, monkeypatch, caplog):
    monkeypatch.setattr(lease, "LEASE_S", 2.0)
    folder = f"{s3_bucket['url']}/run"
    manager = hdcp.CheckpointManager(folder)
    manager.save(1, full_state(seed=1))
    manager.close()
    proc = _python(_KILLED_MULTIPART, folder)
    try:
        assert proc.stdout.readline().strip() == b"part", proc.stderr.read()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    killed = _uploads(f"{folder}/step-2/")
    assert len(killed) == 1 and killed[0].endswith(".safetensors")  # parts stored, no object
    assert not hdcp.is_checkpoint(f"{folder}/step-2")
    lock = json.loads(_fs().cat_file(f"{folder[len('s3://'):]}/{lease.LOCK_OBJECT}"))
    assert lock["holder"].startswith(f"pid {proc.pid} on ")  # the killed job's lock is left behind
    started = time.monotonic()
    resumed = hdcp.CheckpointManager(folder)  # waits for the dead lease to run out, takes it over
    assert time.monotonic() - started >= 1.0
    assert "took over" in caplog.text
    assert _uploads(f"{folder}/") == []  # its multipart upload aborted
    assert resumed.committed_steps() == [1]
    target = blank_state()
    assert resumed.load_latest(target) == 1
    resumed.save(2, full_state(seed=2))
    assert load_and_check(resumed.checkpoint_path(2), [None], seed=2, no_dist=True)
    resumed.close()


def test_retention_aborts_the_jobs_incomplete_uploads_only(s3_bucket):
    folder = f"{s3_bucket['url']}/run"
    manager = hdcp.CheckpointManager(folder, keep_last_n=1)
    ours = f"{folder}/step-5/__0_0.{_SAVE_ID}.safetensors"  # a failed save's upload, left incomplete
    others = [f"{folder}/notes.bin", f"{folder}/step-5/upload.bin", f"{s3_bucket['url']}/elsewhere/step-5/"
              f"__0_0.{_SAVE_ID}.safetensors"]
    for url in (ours, *others):
        _start_upload(url)
    manager.save(1, full_state(seed=1))
    bucket = s3_bucket["url"][len("s3://"):]
    assert _uploads(f"{s3_bucket['url']}/") == sorted(u[len(f"s3://{bucket}/"):] for u in others)
    manager.close()
