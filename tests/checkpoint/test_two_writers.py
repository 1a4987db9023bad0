"""Two jobs on one folder, a corrupt latest checkpoint on resume, failed async saves
leave no staging directory behind."""

from __future__ import annotations

import glob
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hyper_parallel import checkpoint as hdcp
from tests.checkpoint.helpers import FailingWriter, blank_state, full_state
from tests.multirank import run_on_ranks

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
T = 120


def _other_job(folder):
    """A second process holding a manager on ``folder`` with a save in progress."""
    code = textwrap.dedent(f"""
        import os, sys
        from hyper_parallel import checkpoint as hdcp
        manager = hdcp.CheckpointManager({folder!r})
        os.makedirs(os.path.join({folder!r}, ".step-2.staging-abc123"))  # its save in progress
        print("ready", flush=True)
        sys.stdin.readline()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_second_job_is_refused_and_never_deletes_the_first_jobs_staging(tmp_path):
    folder = str(tmp_path / "ckpts")
    other = _other_job(folder)
    try:
        with pytest.raises(hdcp.CheckpointError, match="in use by another job"):
            hdcp.CheckpointManager(folder)
        assert os.path.isdir(os.path.join(folder, ".step-2.staging-abc123"))
    finally:
        other.communicate("\n", timeout=60)
    manager = hdcp.CheckpointManager(folder)  # the other job ended: its lock is gone
    assert not os.path.exists(os.path.join(folder, ".step-2.staging-abc123"))  # crashed-run leftovers go
    second = hdcp.CheckpointManager(folder)  # managers of one process share the lock
    second.close()
    manager.close()


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    folder = str(tmp_path / "ckpts")
    manager = hdcp.CheckpointManager(folder)
    for step in (1, 2):
        manager.save(step, {"w": torch.full((4,), float(step)), "step": step})
    data = sorted(glob.glob(os.path.join(folder, "step-2", "*.safetensors")))[0]
    with open(data, "r+b") as f:
        f.seek(-2, os.SEEK_END)
        f.write(b"\xff\xff")
    state = {"w": torch.zeros(4), "step": 0}
    with caplog.at_level(logging.WARNING):
        assert manager.load_latest(state) == 1
    assert torch.equal(state["w"], torch.full((4,), 1.0)) and state["step"] == 1
    lines = [r.getMessage() for r in caplog.records if "corrupt" in r.getMessage()]
    assert len(lines) == 1 and "step-2" in lines[0] and "step-1" in lines[0] and "\n" not in lines[0]
    # A sound checkpoint that does not fit the state is an error, not a reason to go back.
    with pytest.raises(hdcp.CheckpointError):
        manager.load_latest({"w": torch.zeros(5), "step": 0})
    manager.close()


def test_every_checkpoint_corrupt_raises(tmp_path):
    folder = str(tmp_path / "ckpts")
    manager = hdcp.CheckpointManager(folder)
    manager.save(1, {"w": torch.ones(4)})
    with open(os.path.join(folder, "step-1", "metadata.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(hdcp.CheckpointError, match="no loadable checkpoint"):
        manager.load_latest({"w": torch.zeros(4)})
    manager.close()


class _DiskFull(hdcp.FileSystemWriter):
    def execute_write(self, plan, planner):
        raise OSError(28, "No space left on device (simulated)")


def _staging_dirs(parent):
    return glob.glob(os.path.join(parent, ".*.staging-*"))


def test_failed_async_save_removes_its_staging_dir(tmp_path):
    path = str(tmp_path / "ckpt")
    future = hdcp.async_save(full_state(), checkpoint_id=path, storage_writer=_DiskFull(sync_files=False),
                             no_dist=True)
    assert isinstance(future.exception(timeout=T), OSError)
    assert _staging_dirs(str(tmp_path)) == []
    hdcp.save(full_state(), checkpoint_id=path, no_dist=True)  # the next save works
    hdcp.load(blank_state(), checkpoint_id=path, no_dist=True)


def _async_fails_on_rank1(path):
    future = hdcp.async_save(full_state(), checkpoint_id=path, storage_writer=FailingWriter(sync_files=False))
    error = future.exception(timeout=T)
    torch.distributed.barrier()
    return type(error).__name__, _staging_dirs(os.path.dirname(path))


def test_failed_async_save_on_one_of_two_ranks_removes_the_staging_dir(tmp_path):
    results = run_on_ranks(2, _async_fails_on_rank1, str(tmp_path / "ckpt"), timeout=T)
    assert [r[0] for r in results] == ["CheckpointError", "OSError"]
    assert all(r[1] == [] for r in results), results


def test_file_system_without_flock_works_unlocked_with_a_warning(tmp_path, caplog, monkeypatch):
    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    folder = str(tmp_path / "ckpts")
    with caplog.at_level(logging.WARNING):
        manager = hdcp.CheckpointManager(folder)
    assert any("cannot lock" in r.getMessage() for r in caplog.records)
    manager.save(1, {"w": torch.ones(3)})
    state = {"w": torch.zeros(3)}
    assert manager.load_latest(state) == 1 and torch.equal(state["w"], torch.ones(3))
    manager.close()
