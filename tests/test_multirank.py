"""The multi-rank harness itself: results, surfaced tracebacks, timeouts and recovery."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.multirank import RankError, run_on_ranks


def _all_reduce_rank():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 blocks here; the pool must not hang


def _sleep(seconds):
    time.sleep(seconds)


@pytest.mark.parametrize("world", [2, 4])
def test_results_in_rank_order(world):
    results = run_on_ranks(world, _all_reduce_rank)
    total = sum(range(world))
    assert results == [(r, world, float(total)) for r in range(world)]


def test_failing_rank_traceback_is_surfaced_and_pool_recovers():
    with pytest.raises(RankError, match="boom on rank one"):
        run_on_ranks(2, _fail_on_rank_one, timeout=60)
    assert run_on_ranks(2, _all_reduce_rank)[0] == (0, 2, 1.0)


def test_timeout_kills_and_recovers():
    with pytest.raises(TimeoutError):
        run_on_ranks(2, _sleep, 30, timeout=2)
    assert run_on_ranks(2, _all_reduce_rank)[1] == (1, 2, 1.0)
