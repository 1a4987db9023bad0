"""On memory://: what a waiting rank reads while it polls for the commit, and the folder lease
(``object_store/lease.py``) of CheckpointManager: shared within a process, refused to a live
holder's rival, taken over from a dead one, and a holder that lost it saves no more."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.format.metadata import METADATA_FILE
from hyper_parallel.core.distributed_checkpoint.object_store import lease, store
from hyper_parallel.core.distributed_checkpoint.object_store.conditional import ObjectOps
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan
from tests.checkpoint.helpers import full_state

fsspec = pytest.importorskip("fsspec", reason="object storage needs fsspec (pip install 'hyper_parallel[s3]')")


def test_waiting_rank_does_not_reread_the_replaced_metadata_while_others_write(memory_url, monkeypatch):
    hdcp.save(full_state(seed=1), checkpoint_id=memory_url, no_dist=True)  # the checkpoint being replaced
    fs, path = fsspec.core.url_to_fs(memory_url)
    writer = hdcp.FsspecWriter(memory_url, commit_timeout_s=30)
    writer.initialize_writer(None)
    writer.configure_writer(False, rank=1, world_size=2)
    save_id = "cd" * 16
    marker = f"{path}/{store.DONE_MARKER.format(1, save_id)}"
    fs.pipe_file(marker, b"{}")  # rank 1 published its part; the coordinator has not collected it yet
    reads = []
    real_read = store.read_metadata
    monkeypatch.setattr(store, "read_metadata", lambda *a: reads.append(1) or real_read(*a))
    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("md", writer.wait_committed(SavePlan([], save_id=save_id))))
    waiter.start()
    time.sleep(1.0)  # several polls while the other ranks still write
    assert reads == []
    # The coordinator collects the marker, then commits the new metadata.
    metadata = real_read(fs, path, memory_url)
    metadata.save_id = save_id
    fs.rm(marker)
    fs.pipe_file(f"{path}/{METADATA_FILE}", metadata.to_json().encode())
    waiter.join(timeout=30)
    assert result["md"].save_id == save_id and len(reads) == 1


def _lock_object(folder):
    fs, path = fsspec.core.url_to_fs(folder)
    return fs, f"{path}/{lease.LOCK_OBJECT}"


def test_lease_is_shared_in_a_process_refused_to_a_rival_and_released(memory_url, monkeypatch):
    monkeypatch.setattr(lease, "LEASE_S", 0.8)
    folder = memory_url.rsplit("/", 1)[0]
    fs, lock = _lock_object(folder)
    first = hdcp.CheckpointManager(folder)
    second = hdcp.CheckpointManager(folder)  # same process: shares the lease
    holder = json.loads(fs.cat_file(lock))
    assert holder["holder"].startswith(f"pid {os.getpid()} on ")
    # Another job (another lease of its own) watches the lock, sees it renewed, and is refused.
    rival = lease.FolderLease(ObjectOps(fs), fs._strip_protocol(folder), folder)
    refusal = rival.acquire()
    assert refusal is not None and "is in use by another job (pid" in refusal, refusal
    first.close()
    assert fs.exists(lock)  # still used by the second manager
    second.close()
    assert not fs.exists(lock)
    assert rival.acquire() is None  # free now
    rival.release()


def test_a_dead_holders_lease_is_taken_over_and_a_live_one_that_lost_it_saves_no_more(memory_url, monkeypatch):
    monkeypatch.setattr(lease, "LEASE_S", 0.8)
    folder = memory_url.rsplit("/", 1)[0]
    fs, lock = _lock_object(folder)
    # A job killed with kill -9 left its lock, renewed just now: watched for half a lease at least.
    fs.pipe_file(lock, json.dumps({"holder": "pid 1 on elsewhere", "token": "x", "renewed": time.time(),
                                   "lease_s": 0.8}).encode())
    started = time.monotonic()
    manager = hdcp.CheckpointManager(folder)
    assert time.monotonic() - started >= 0.4
    assert json.loads(fs.cat_file(lock))["token"] != "x"
    manager.save(1, full_state(seed=1))
    # Another job replaces the lock (it judged this one dead): the next save is refused.
    fs.pipe_file(lock, json.dumps({"holder": "pid 2 on elsewhere", "token": "y", "renewed": time.time(),
                                   "lease_s": 0.8}).encode())
    time.sleep(0.6)  # a renewal (every 0.2 s) finds the other token
    with pytest.raises(hdcp.CheckpointError, match="lost the lock .*another job replaced it"):
        manager.save(2, full_state(seed=2))
    assert manager.committed_steps() == [1]
    manager.close()
    assert json.loads(fs.cat_file(lock))["token"] == "y"  # not deleted: it is the other job's


def test_a_folder_without_write_access_for_the_lock_is_used_unlocked_with_a_warning(memory_url, monkeypatch,
                                                                                     caplog):
    folder = memory_url.rsplit("/", 1)[0]
    hdcp.save(full_state(seed=4), checkpoint_id=f"{folder}/step-4", no_dist=True)

    def refused(self, path, data):
        raise PermissionError(f"access denied: {path}")

    monkeypatch.setattr(ObjectOps, "create", refused)
    manager = hdcp.CheckpointManager(folder)  # e.g. read-only credentials, only to resume from
    assert "cannot lock" in caplog.text and manager.latest_step() == 4
    manager.close()


def test_file_url_lock_is_created_exclusively(tmp_path):
    from hyper_parallel.core.distributed_checkpoint.object_store.conditional import LocalOps, object_ops

    fs, path = fsspec.core.url_to_fs(f"file://{tmp_path}/run")
    ops = object_ops(fs)
    assert isinstance(ops, LocalOps)
    lock = f"{path}/{lease.LOCK_OBJECT}"
    first = ops.create(lock, b"one")
    assert first == b"one" and ops.create(lock, b"two") is None
    assert ops.replace(lock, b"three", b"two") is None and ops.replace(lock, b"three", first) == b"three"
    assert sorted(os.listdir(tmp_path / "run")) == [lease.LOCK_OBJECT]  # nothing left aside
    manager = hdcp.CheckpointManager(f"file://{tmp_path}/other")
    assert os.path.isfile(tmp_path / "other" / lease.LOCK_OBJECT)
    manager.close()
    assert not os.path.exists(tmp_path / "other" / lease.LOCK_OBJECT)


def test_a_foreign_lock_object_is_refused_in_one_line(memory_url):
    folder = memory_url.rsplit("/", 1)[0]
    fs, lock = _lock_object(folder)
    fs.pipe_file(lock, b"not json")
    with pytest.raises(hdcp.CheckpointError, match=r"\.hyper_parallel\.lock is not a lock of this library; delete it"):
        hdcp.CheckpointManager(folder)
    assert fs.cat_file(lock) == b"not json"  # never overwritten
