"""One store per backend, chosen once from the checkpoint id (``hdcp.store_for``): a path gives a
``LocalStore``, an fsspec URL an ``ObjectStore``, and both answer the same questions the same
way (writer, reader, committed, metadata, verification, a folder's steps, hold, removal)."""

from __future__ import annotations

import uuid

import pytest
import torch

from hyper_parallel import checkpoint as hdcp


@pytest.fixture(params=["local", "memory"])
def folder(request, tmp_path) -> str:
    return str(tmp_path / "run") if request.param == "local" else f"memory://stores-{uuid.uuid4().hex}/run"


def _save(store: hdcp.CheckpointStore, step: int) -> None:
    target = store.step(step)
    hdcp.save({"w": torch.arange(6.0).reshape(2, 3), "step": step}, checkpoint_id=target.location,
              storage_writer=target.writer(), no_dist=True)


def test_store_for_picks_the_backend_once(tmp_path):
    local, remote = hdcp.store_for(tmp_path / "run"), hdcp.store_for("memory://bucket/run/")
    assert isinstance(local, hdcp.LocalStore) and isinstance(local, hdcp.CheckpointStore)
    assert isinstance(remote, hdcp.ObjectStore) and isinstance(remote, hdcp.CheckpointStore)
    assert local.location == str(tmp_path / "run") and remote.location == "memory://bucket/run"
    assert isinstance(local.writer(), hdcp.FileSystemWriter) and isinstance(local.reader(), hdcp.FileSystemReader)
    assert isinstance(remote.writer(), hdcp.FsspecWriter) and isinstance(remote.reader(), hdcp.FsspecReader)
    assert not local.lock_can_be_lost and remote.lock_can_be_lost  # flock vs lease
    with pytest.raises(ValueError, match="no-such-scheme"):
        hdcp.store_for("no-such-scheme://bucket/run")


def test_both_backends_answer_alike(folder):
    store = hdcp.store_for(folder)
    assert store.committed_steps() == [] and not store.is_checkpoint()
    assert store.hold() is None  # one job per folder: held by this process now
    try:
        _save(store, 3)
        _save(store, 10)
        assert store.committed_steps() == [3, 10]
        assert store.step(10).location == f"{folder}/step-10"
        assert hdcp.checkpoint_step(store.step(10).location) == 10
        step = store.step(10)
        assert step.is_checkpoint() and hdcp.is_checkpoint(step.location)
        assert step.read_metadata().save_id == step.verify().save_id
        loaded = {"w": torch.zeros(2, 3), "step": 0}
        hdcp.load(loaded, checkpoint_id=step.location, storage_reader=step.reader(), no_dist=True)
        assert loaded["step"] == 10 and torch.equal(loaded["w"], torch.arange(6.0).reshape(2, 3))
        assert hdcp.resolve_checkpoint(folder) == step.location
        store.step(3).remove()
        assert store.committed_steps() == [10] and not store.step(3).is_checkpoint()
        with pytest.raises(hdcp.CheckpointError, match="not a committed checkpoint"):
            store.step(3).read_metadata()
    finally:
        store.release()
        store.release()  # once: a second release gives nothing back twice


def test_write_problems_name_the_location(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    why = hdcp.store_for(blocker / "ckpt").write_problem("checkpoint.folder")
    assert why == (f"checkpoint.folder={blocker}/ckpt cannot be used: {blocker} is a file, not a folder; "
                   "choose another checkpoint.folder")
    assert hdcp.store_for(tmp_path / "fresh").write_problem("checkpoint.folder") is None
    assert (tmp_path / "fresh").is_dir()
    assert hdcp.store_for(f"memory://stores-{uuid.uuid4().hex}/run").write_problem("checkpoint.folder") is None
