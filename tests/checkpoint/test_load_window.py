"""Concurrent reader threads of one load share its window of bounce slabs and never wait on
each other: a reader that holds a slab reuses its oldest one instead of waiting for the pool
(bounce.py), so a budget smaller than ``thread_count`` x window cannot deadlock a load.

Every wait here has a timeout, so a deadlock fails the test instead of hanging the suite.
"""

from __future__ import annotations

import os
import threading
import time
from typing import List

import pytest
import torch

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.host_memory.bounce import BounceReads
from hyper_parallel.core.distributed_checkpoint.host_memory.staging_buffers import StagingBuffers
from tests.checkpoint.helpers import BOX_COLS, BOX_ROWS, AppliedBoxes, box_read

JOIN_S = 20.0


def _join_all(threads: List[threading.Thread]) -> None:
    deadline = time.monotonic() + JOIN_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "reader threads deadlocked on the slab pool"


def test_two_readers_holding_the_whole_budget_do_not_deadlock(tmp_path):
    """The reviewer's case: 1 KiB slabs, a 4-slab budget and window, two readers holding two
    slabs each when both need a third. Each reuses its oldest slab; the bytes land intact."""
    pool = StagingBuffers(slab_bytes=1024, budget_bytes=4096, sync_window_bytes=4096)
    stored = torch.arange(2 * 3 * BOX_ROWS * BOX_COLS, dtype=torch.float64).reshape(2, 3, BOX_ROWS, BOX_COLS)
    path = str(tmp_path / "chunks.bin")
    with open(path, "wb") as f:
        f.write(stored.numpy().tobytes())
    window, planner = pool.window(snapshot=False), AppliedBoxes()
    readers = [BounceReads(pool, window, planner, torch.device("cpu")) for _ in range(2)]
    dests = [[torch.zeros(BOX_COLS, BOX_ROWS, dtype=torch.float64).t() for _ in range(3)] for _ in range(2)]
    in_use_when_held: List[int] = []
    holding = threading.Barrier(2, action=lambda: in_use_when_held.append(pool.in_use), timeout=JOIN_S)
    errors: List[BaseException] = []
    fd = os.open(path, os.O_RDONLY)

    def read(r: int) -> None:
        try:
            for b in range(3):
                if b == 2:
                    holding.wait()  # both hold two slabs: the budget and the window are used up
                offset = (r * 3 + b) * BOX_ROWS * BOX_COLS * 8
                readers[r].read(fd, path, offset, (BOX_ROWS, BOX_COLS), box_read(f"r{r}b{b}"), dests[r][b],
                                torch.float64)
            readers[r].finish()
        except BaseException as exc:  # noqa: BLE001  (reported by the main thread)
            errors.append(exc)
            holding.abort()

    try:
        threads = [threading.Thread(target=read, args=(r,), daemon=True) for r in range(2)]
        for thread in threads:
            thread.start()
        _join_all(threads)
    finally:
        os.close(fd)
    assert not errors, errors
    assert in_use_when_held == [4]
    for r in range(2):
        for b in range(3):
            assert torch.equal(dests[r][b], stored[r, b]), (r, b)
    assert sorted(planner.applied) == sorted(f"r{r}b{b}" for r in range(2) for b in range(3))
    assert pool.in_use == 0 and pool.allocations == 4


@pytest.fixture
def tiny_budget():
    """The process pool with 1 KiB slabs and a 4 KiB budget and window."""
    pool = hdcp.staging_buffers()
    before = dict(slab_bytes=pool.slab_bytes, budget_bytes=pool.budget_bytes, sync_window_bytes=pool.sync_window_bytes)
    hdcp.wait_for_pending_save()
    pool.configure(slab_bytes=1024, budget_bytes=4096, sync_window_bytes=4096)
    pool.release()
    yield pool
    pool.configure(**before)
    pool.release()


def test_threaded_load_into_strided_destinations_within_a_small_budget(tmp_path, tiny_budget):
    """FileSystemReader(thread_count=2) bouncing many strided boxes through a 4-slab budget
    shared by both readers: the load completes exactly and within the budget."""
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(BOX_COLS, 2 * BOX_ROWS, generator=g, dtype=torch.float64) for i in range(8)}
    path = str(tmp_path / "ckpt")
    hdcp.save(state, checkpoint_id=path, no_dist=True)
    target = {key: torch.zeros(2 * BOX_ROWS, BOX_COLS, dtype=torch.float64).t() for key in state}  # strided: bounces
    start, errors = tiny_budget.allocations, []

    def load() -> None:
        try:
            hdcp.load(target, storage_reader=hdcp.FileSystemReader(path, thread_count=2), no_dist=True, verify=False)
        except BaseException as exc:  # noqa: BLE001  (reported by the main thread)
            errors.append(exc)

    loader = threading.Thread(target=load, daemon=True)
    loader.start()
    loader.join(JOIN_S)
    if loader.is_alive():  # deadlocked: lift the budget and wake the readers, so the process can exit
        tiny_budget.configure(slab_bytes=1024, budget_bytes=None, sync_window_bytes=4096)
        tiny_budget.fail(tiny_budget.window(snapshot=False), RuntimeError("wake up"))
        loader.join(JOIN_S)
        pytest.fail("the load's reader threads deadlocked on the slab pool")
    assert not errors, errors
    for key, value in state.items():
        assert torch.equal(target[key], value), key
    assert 0 < tiny_budget.allocations - start <= 4 and tiny_budget.in_use == 0
