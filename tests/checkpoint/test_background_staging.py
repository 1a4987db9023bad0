"""async_save(..., stage_in_background=True): returns after planning, stages in the background,
and in-place updates (the hooked optimizer.step(), or after an explicit wait_for_staging())
never reach the checkpoint.

A planner that sleeps before the first chunk is staged makes staging reliably slower than
the training step that follows, so an update that did not wait would land in the checkpoint.
"""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from hyper_parallel import checkpoint as hdcp
from hyper_parallel import fully_shard
from hyper_parallel.core.distributed_checkpoint.host_memory.background import optimizers_in
from hyper_parallel.core.distributed_checkpoint.host_memory.snapshot import StagedSave
from tests.checkpoint.helpers import app_state, full_state, load_and_check, local_tensor_clones
from tests.multirank import run_on_ranks

T = 120
DELAY = 1.0  # seconds staging sleeps before its first chunk


class SlowStaging(hdcp.StandardSavePlanner):
    """Sleeps ``DELAY`` s before serving the first tensor chunk (staging); fails there on
    ``fail_rank`` instead."""

    def __init__(self, fail_rank: int = -1) -> None:
        super().__init__()
        self._fail_rank, self._started = fail_rank, False

    def get_data(self, item):
        if item.type == hdcp.WriteItemType.TENSOR and not self._started:
            self._started = True
            time.sleep(DELAY)
            rank = dist.get_rank() if dist.is_initialized() else 0
            if rank == self._fail_rank:
                raise RuntimeError("staging failed (simulated)")
        return super().get_data(item)


def _sharded_mlp_and_adamw(seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)).double()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _adamw_step(model, optim, seed: int) -> None:
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + dist.get_rank()))
    model(x).pow(2).sum().backward()
    optim.step()
    optim.zero_grad()


def _assert_same(actual, expected):
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), f"{key} differs from the state at the call"


def _assert_checkpoint_holds(path, expected, *, with_optimizer: bool = True) -> None:
    """Load ``path`` into a fresh model (and optimizer) and compare with ``expected`` exactly."""
    model, optim = _sharded_mlp_and_adamw(1)
    fresh = app_state(model, optim) if with_optimizer else {"model": hdcp.ModelState(model)}
    hdcp.load(fresh, checkpoint_id=path)
    _assert_same(local_tensor_clones(fresh), expected)


def _step_right_after_save(path):
    """async_save with background staging, then at once a training step: the hooked
    optimizer.step() waits, and the checkpoint holds the state at the call."""
    model, optim = _sharded_mlp_and_adamw(0)
    _adamw_step(model, optim, 0)  # the optimizer has state
    state = app_state(model, optim)
    at_call = local_tensor_clones(state)
    future = hdcp.async_save(state, checkpoint_id=path, planner=SlowStaging(), stage_in_background=True)
    assert isinstance(future, hdcp.AsyncSaveFuture)
    assert not future.staging_completion.done()  # returned before staging (which sleeps DELAY s)
    _adamw_step(model, optim, 1)  # optimizer.step() waits for staging
    assert future.staging_completion.done()
    assert any(not torch.equal(v, at_call[k]) for k, v in local_tensor_clones(state).items())  # it did update
    future.result(timeout=60)
    _assert_checkpoint_holds(path, at_call)
    return True


def test_optimizer_step_right_after_async_save_waits_for_staging(tmp_path):
    assert all(run_on_ranks(2, _step_right_after_save, str(tmp_path / "ckpt"), timeout=T))


def _manager_in_background(folder):
    """The manager passes stage_in_background on; its wait_for_staging() and the hook work."""
    model, optim = _sharded_mlp_and_adamw(0)
    _adamw_step(model, optim, 0)
    state = app_state(model, optim)
    manager = hdcp.CheckpointManager(folder, async_save=True, stage_in_background=True)
    at_call = []
    for step in (1, 2):
        at_call.append(local_tensor_clones(state))
        future = manager.save(step, state)
        assert isinstance(future, hdcp.AsyncSaveFuture)
        if step == 2:
            manager.wait_for_staging()
            assert future.staging_completion.done()
        _adamw_step(model, optim, step)
    manager.wait()
    for step in (2, 1):
        _assert_checkpoint_holds(manager.checkpoint_path(step), at_call[step - 1])
    manager.close()
    return True


def test_manager_saves_with_background_staging(tmp_path):
    assert all(run_on_ranks(2, _manager_in_background, str(tmp_path), timeout=T))


def _wait_then_add(path):
    """No optimizer in the state: wait_for_staging() is what makes param.add_() safe."""
    model, optim = _sharded_mlp_and_adamw(0)
    state = {"model": hdcp.ModelState(model)}
    at_call = local_tensor_clones(state)
    future = hdcp.async_save(state, checkpoint_id=path, planner=SlowStaging(), stage_in_background=True)
    assert not future.staging_completion.done()
    future.wait_for_staging()
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().add_(1.0)
    future.result(timeout=60)
    _assert_checkpoint_holds(path, at_call, with_optimizer=False)
    return True


def test_explicit_wait_for_staging_then_in_place_add(tmp_path):
    assert all(run_on_ranks(2, _wait_then_add, str(tmp_path / "ckpt"), timeout=T))


def _staging_failure(root):
    model, optim = _sharded_mlp_and_adamw(0)
    _adamw_step(model, optim, 0)
    future = hdcp.async_save(app_state(model, optim), checkpoint_id=os.path.join(root, "ckpt"),
                             planner=SlowStaging(fail_rank=1), stage_in_background=True)
    if dist.get_rank() == 1:
        with pytest.raises(RuntimeError, match="staging failed"):
            _adamw_step(model, optim, 1)  # the hook reports the staging error
        with pytest.raises(RuntimeError, match="staging failed"):
            future.wait_for_staging()
    else:
        _adamw_step(model, optim, 1)  # rank 0 staged fine; its commit fails below
        future.wait_for_staging()
    optim.zero_grad()
    _adamw_step(model, optim, 2)  # reported once: the next step runs
    with pytest.raises((RuntimeError, hdcp.CheckpointError)):
        future.result(timeout=60)
    dist.barrier()
    assert hdcp.staging_buffers().in_use == 0
    return sorted(os.listdir(root))


def test_failure_during_background_staging_surfaces_and_cleans_up(tmp_path):
    listings = run_on_ranks(2, _staging_failure, str(tmp_path), timeout=T)
    assert listings == [[], []]  # the staging folder was removed, nothing committed


def test_next_load_into_the_same_tensors_waits_for_staging(tmp_path):
    hdcp.save(full_state(seed=1), checkpoint_id=str(tmp_path / "one"), no_dist=True)
    state = full_state(seed=0)
    future = hdcp.async_save(state, checkpoint_id=str(tmp_path / "zero"), no_dist=True,
                             planner=SlowStaging(), stage_in_background=True)
    hdcp.load(state, checkpoint_id=str(tmp_path / "one"), no_dist=True)  # overwrites in place
    future.result(timeout=60)
    assert load_and_check(str(tmp_path / "zero"), [None], seed=0, no_dist=True)


def test_plain_tensor_changed_before_staging_still_commits_a_checkpoint_that_verifies(tmp_path, monkeypatch):
    # Misuse (no wait_for_staging() before the in-place update), but the committed checkpoint
    # must hold what was written, with the checksum of those bytes. The standard
    # planner (its planning checksums of plain tensors) with staging held back DELAY s.
    produce = StagedSave.produce

    def slow_produce(self, start_writer):
        time.sleep(DELAY)
        produce(self, start_writer)

    monkeypatch.setattr(StagedSave, "produce", slow_produce)
    path = str(tmp_path / "ckpt")
    w = torch.ones(1000)
    future = hdcp.async_save({"w": w, "n": 3}, checkpoint_id=path, no_dist=True, stage_in_background=True)
    w.add_(1)
    future.result(timeout=60)
    hdcp.verify_checkpoint(path)
    state = {"w": torch.zeros(1000), "n": 0}
    hdcp.load(state, checkpoint_id=path, no_dist=True)
    assert torch.equal(state["w"], torch.full((1000,), 2.0)) and state["n"] == 3


def test_background_saves_reuse_staging_buffers(tmp_path):
    buffers = hdcp.staging_buffers()
    for i in range(6):
        future = hdcp.async_save(full_state(seed=i % 3), checkpoint_id=str(tmp_path / f"s{i}"), no_dist=True,
                                 stage_in_background=True)
        future.result(timeout=60)
        if i == 0:
            allocations, nbytes = buffers.allocations, buffers.nbytes
            assert allocations > 0
    assert buffers.allocations == allocations and buffers.nbytes == nbytes and buffers.in_use == 0
    for i in (0, 5):
        assert load_and_check(str(tmp_path / f"s{i}"), [None], seed=i % 3, no_dist=True)


def test_plain_optimizer_in_the_state_is_hooked(tmp_path):
    weight = nn.Parameter(torch.arange(12, dtype=torch.float64).reshape(3, 4))
    sgd = torch.optim.SGD([weight], lr=1.0)
    assert optimizers_in({"w": weight, "opt": sgd, "n": 3}) == [sgd]
    future = hdcp.async_save({"w": weight.detach(), "opt": sgd}, checkpoint_id=str(tmp_path / "c"), no_dist=True,
                             planner=SlowStaging(), stage_in_background=True)
    weight.grad = torch.ones_like(weight)
    assert not future.staging_completion.done()
    sgd.step()  # waits
    future.result(timeout=60)
    loaded = {"w": torch.zeros(3, 4, dtype=torch.float64)}
    hdcp.load(loaded, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert torch.equal(loaded["w"], torch.arange(12, dtype=torch.float64).reshape(3, 4))
    assert torch.equal(weight.detach(), loaded["w"] - 1)


def test_stage_in_background_needs_async_save(tmp_path):
    with pytest.raises(ValueError, match="needs async_save"):
        hdcp.CheckpointManager(str(tmp_path), stage_in_background=True)


def test_docs_background_snippet_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "checkpoint.md")
    with open(doc) as f:
        snippet = next(s for s in re.findall(r"```python\n(.*?)```", f.read(), re.S) if "stage_in_background" in s)
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scope = {"hdcp": hdcp, "model": model, "optim": optim, "batch": torch.ones(2, 4, dtype=torch.float64)}
    exec(snippet, scope)  # noqa: S102 - the documentation's own code
    loaded = {"model": {k: torch.zeros_like(v) for k, v in before.items()}}
    hdcp.load(loaded, checkpoint_id="ckpt/step-300", no_dist=True)
    _assert_same(loaded["model"], before)
    assert not torch.equal(model.weight.detach(), before["weight"])  # the step ran after the save
