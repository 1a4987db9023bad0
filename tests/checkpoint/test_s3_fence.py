"""The lease fence (``object_store/lease.py``): a job whose folder lease was taken over while it
stalled commits nothing and deletes nothing of the new holder's, on its very next save. The
stall is simulated by a lease whose renewal period outlasts the test (the stalled job's renewal
thread never runs), so the other job finds it unrenewed and takes the folder over; on moto's S3
server (``s3_server.py``) with conditional requests, and on ``memory://`` (compare-then-write)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.object_store import lease, store
from hyper_parallel.core.distributed_checkpoint.object_store.conditional import ObjectOps, object_ops
from tests.checkpoint.helpers import full_state, load_and_check

pytestmark = pytest.mark.timeout(300)
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_STALLED_LEASE_S = 600.0  # renewed every 150 s: never while the test runs

# The job that takes the folder over: its own lease is short, so it judges the stalled job's
# lock dead after a few seconds; it saves step 5, then holds the folder until told to check.
_NEW_HOLDER = """
import sys
from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.object_store import lease
from tests.checkpoint.helpers import full_state, load_and_check

lease.LEASE_S = 1.0
manager = hdcp.CheckpointManager(sys.argv[1])
manager.save(5, full_state(seed=5))
print("saved", flush=True)
sys.stdin.readline()
assert manager.latest_step() == 5
assert load_and_check(manager.checkpoint_path(5), [None], seed=5, no_dist=True)
manager.close()
print("own values", flush=True)
"""


def _names(fs, path):
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.find(path))


def test_a_stalled_holder_that_was_taken_over_commits_and_deletes_nothing(s3_bucket, monkeypatch):
    import s3fs

    monkeypatch.setattr(lease, "LEASE_S", _STALLED_LEASE_S)
    folder = f"{s3_bucket['url']}/run"
    stalled = hdcp.CheckpointManager(folder)
    stalled.save(1, full_state(seed=1))
    new_holder = subprocess.Popen([sys.executable, "-c", _NEW_HOLDER, folder], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=_REPO))
    try:
        line = new_holder.stdout.readline()
        assert line.strip() == b"saved", new_holder.stderr.read() if new_holder.poll() is not None else line
        fs = s3fs.S3FileSystem()
        step5 = f"{folder[len('s3://'):]}/step-5"
        theirs = _names(fs, step5)
        # The stalled job continues: its save must not replace the new holder's step-5.
        with pytest.raises(hdcp.CheckpointError) as refused:
            stalled.save(5, full_state(seed=9))
        message = str(refused.value)
        assert message.startswith(f"refusing to commit {folder}/step-5: lost the lock {folder}/{lease.LOCK_OBJECT}: "
                                  f"another job replaced it (pid {new_holder.pid} on "), message
        assert _names(fs, step5) == theirs  # its objects are gone again, the other job's untouched
        assert load_and_check(f"{folder}/step-5", [None], seed=5, no_dist=True)
        with pytest.raises(hdcp.CheckpointError, match="lost the lock"):  # and so is every later save
            stalled.save(6, full_state(seed=6))
        new_holder.stdin.write(b"check\n")
        new_holder.stdin.flush()
        out, err = new_holder.communicate(timeout=120)
        assert new_holder.returncode == 0 and out.strip() == b"own values", err
    finally:
        if new_holder.poll() is None:
            new_holder.kill()  # this test's own child, by its handle
            new_holder.wait()
    stalled.close()
    after = hdcp.CheckpointManager(folder)
    assert after.committed_steps() == [1, 5]
    after.close()


def _take_over(folder: str) -> None:
    """Replace the folder's lock as another job taking it over would (conditional on its version)."""
    fs, path = store.open_store(folder)
    ops = object_ops(fs)
    lock = f"{path}/{lease.LOCK_OBJECT}"
    _, version = ops.read(lock)
    body = {"holder": "pid 4242 on otherhost", "token": "other", "renewed": time.time(), "lease_s": 60.0}
    assert ops.replace(lock, json.dumps(body).encode(), version) is not None


def test_an_async_save_after_a_takeover_is_refused_before_its_commit(s3_bucket, monkeypatch):
    monkeypatch.setattr(lease, "LEASE_S", _STALLED_LEASE_S)
    folder = f"{s3_bucket['url']}/run"
    manager = hdcp.CheckpointManager(folder, keep_last_n=1, async_save=True)
    manager.save(1, full_state(seed=1))
    manager.wait()
    _take_over(folder)
    future = manager.save(2, full_state(seed=2))
    assert future.exception(timeout=120) is not None
    with pytest.raises(hdcp.CheckpointError, match=r"refusing to commit .*/step-2: .*\(pid 4242 on otherhost;"):
        manager.wait()
    assert manager.committed_steps() == [1]  # and retention deleted nothing
    assert load_and_check(manager.checkpoint_path(1), [None], seed=1, no_dist=True)
    manager.close()
    fs, path = store.open_store(folder)
    assert json.loads(fs.cat_file(f"{path}/{lease.LOCK_OBJECT}"))["token"] == "other"  # left to its holder


def test_memory_folder_save_after_a_takeover_is_refused(memory_url, monkeypatch):
    monkeypatch.setattr(lease, "LEASE_S", _STALLED_LEASE_S)
    folder = memory_url.rsplit("/", 1)[0]
    manager = hdcp.CheckpointManager(folder)
    manager.save(1, full_state(seed=1))
    _take_over(folder)
    with pytest.raises(hdcp.CheckpointError, match="refusing to commit .*another job replaced it"):
        manager.save(1, full_state(seed=7))  # would replace step-1 in place
    assert load_and_check(manager.checkpoint_path(1), [None], seed=1, no_dist=True)
    manager.close()


def test_a_fence_the_store_does_not_answer_passes_only_within_half_a_lease(memory_url, monkeypatch):
    monkeypatch.setattr(lease, "LEASE_S", _STALLED_LEASE_S)
    folder = memory_url.rsplit("/", 1)[0]
    manager = hdcp.CheckpointManager(folder)

    def unreachable(self, path, data, version):
        raise ConnectionError("no route to the store (simulated)")

    monkeypatch.setattr(ObjectOps, "replace", unreachable)
    held = lease._HELD[folder][0]  # this process's lease of the folder
    held.confirm()  # renewed just now: no other job can have judged it dead
    held._renewed -= _STALLED_LEASE_S / 2
    with pytest.raises(hdcp.CheckpointError, match="could not confirm the lock .*ConnectionError"):
        manager.save(1, full_state(seed=1))
    monkeypatch.undo()
    manager.close()
