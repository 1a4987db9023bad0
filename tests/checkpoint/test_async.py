"""async_save: same bytes as save, a snapshot at call time, bounded staging memory, failures."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyper_parallel import checkpoint as hdcp
from tests.checkpoint.helpers import FailingWriter, distribute_state, full_state, load_and_check, message_or
from tests.multirank import run_on_ranks

T = 120


def _async_then_sync(root):
    state = distribute_state(full_state(), "hsdp")
    future = hdcp.async_save(state, checkpoint_id=f"{root}/async")
    metadata = future.result(timeout=60)
    hdcp.save(state, checkpoint_id=f"{root}/sync")
    load_and_check(f"{root}/async", ["fsdp", "hsdp"])
    return metadata.save_id


def test_async_save_commits_like_save_on_4_ranks(tmp_path):
    save_ids = run_on_ranks(4, _async_then_sync, str(tmp_path), timeout=T)
    assert len(set(save_ids)) == 1 and save_ids[0]
    a = hdcp.read_checkpoint_metadata(str(tmp_path / "async"))
    s = hdcp.read_checkpoint_metadata(str(tmp_path / "sync"))
    assert a.state_dict_metadata == s.state_dict_metadata
    assert {k: v.checksum for k, v in a.storage_data.items()} == {k: v.checksum for k, v in s.storage_data.items()}
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no staging left behind


def _mutate_after_return(path):
    state = distribute_state(full_state(), "fsdp")
    future = hdcp.async_save(state, checkpoint_id=path)
    with torch.no_grad():
        for tree in (state["model"], *state["optim"]["state"].values()):
            for value in tree.values():
                (value.to_local() if isinstance(value, DTensor) else value).add_(1)
    state["train"]["step"] = -1
    state["optim"]["param_groups"][0]["lr"] = 123.0
    future.result(timeout=60)
    return load_and_check(path, ["fsdp"])


def test_in_place_changes_after_return_are_not_saved(tmp_path):
    assert all(run_on_ranks(2, _mutate_after_return, str(tmp_path / "ckpt"), timeout=T))


def test_repeated_async_saves_reuse_staging_buffers(tmp_path):
    buffers = hdcp.staging_buffers()
    futures = []
    for i in range(12):
        futures.append(hdcp.async_save(full_state(seed=i % 3), checkpoint_id=str(tmp_path / f"s{i}"), no_dist=True))
        if i == 0:
            allocations, nbytes = buffers.allocations, buffers.nbytes
    for f in futures:
        f.result(timeout=60)
    assert buffers.allocations == allocations and buffers.nbytes == nbytes
    for i in (0, 10, 11):
        assert load_and_check(str(tmp_path / f"s{i}"), [None], seed=i % 3, no_dist=True, verify=True)


def _async_rank_local(path):
    hdcp.async_save(distribute_state(full_state(), "fsdp"), checkpoint_id=path, use_collectives=False).result(60)
    dist.barrier()
    return load_and_check(path, ["shard1"], use_collectives=False)


def test_async_save_without_collectives(tmp_path):
    assert all(run_on_ranks(2, _async_rank_local, str(tmp_path / "ckpt"), timeout=T))


def _async_failure(path):
    future = hdcp.async_save(distribute_state(full_state(), "fsdp"),
                             storage_writer=FailingWriter(path, commit_timeout_s=30))
    return message_or("committed", lambda: future.result(timeout=60), (hdcp.CheckpointError, OSError))


def test_async_failure_on_one_rank_fails_every_future(tmp_path):
    messages = run_on_ranks(2, _async_failure, str(tmp_path / "ckpt"), timeout=T)
    assert all("disk full" in m for m in messages), messages
    assert not hdcp.is_checkpoint(str(tmp_path / "ckpt"))


def test_async_save_waits_for_the_previous_one(tmp_path):
    first = hdcp.async_save(full_state(), checkpoint_id=str(tmp_path / "a"), no_dist=True)
    hdcp.save(full_state(seed=1), checkpoint_id=str(tmp_path / "b"), no_dist=True)
    assert first.done()
    first.result()
    assert load_and_check(str(tmp_path / "a"), [None], no_dist=True)
    with pytest.raises(hdcp.CheckpointError):
        hdcp.load(full_state(), checkpoint_id=str(tmp_path / "missing"), no_dist=True)


class StallingWriter(hdcp.FileSystemWriter):
    def execute_write(self, plan, planner):
        if self.rank == 1:
            time.sleep(3)
        return super().execute_write(plan, planner)


def _async_timeout(path):
    writer = StallingWriter(path, commit_timeout_s=1)
    future = hdcp.async_save(distribute_state(full_state(), "fsdp"), storage_writer=writer)
    return message_or("committed", lambda: future.result(timeout=60))


def test_async_commit_wait_is_bounded(tmp_path):
    messages = run_on_ranks(2, _async_timeout, str(tmp_path / "ckpt"), timeout=T)
    assert "did not finish writing (missing ['.done.rank1.json'])" in messages[0], messages
    assert not hdcp.is_checkpoint(str(tmp_path / "ckpt"))
