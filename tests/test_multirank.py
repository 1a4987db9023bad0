"""The multi-rank harness itself: results, surfaced tracebacks, timeouts and recovery."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.multirank import RankError, run_on_ranks
from tests.process_state import process_state


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


@pytest.mark.slow  # the test harness's own recovery
def test_failing_rank_traceback_is_surfaced_and_pool_recovers():
    with pytest.raises(RankError, match="boom on rank one"):
        run_on_ranks(2, _fail_on_rank_one, timeout=60)
    assert run_on_ranks(2, _all_reduce_rank)[0] == (0, 2, 1.0)


@pytest.mark.slow  # the test harness's own recovery
def test_timeout_kills_and_recovers():
    with pytest.raises(TimeoutError):
        run_on_ranks(2, _sleep, 30, timeout=2)
    assert run_on_ranks(2, _all_reduce_rank)[1] == (1, 2, 1.0)


def _fill_process_state():
    """Leave behind what tests do: counted collectives, a cached save plan, staging buffers, a
    mesh's process groups."""
    import tempfile

    import hyper_parallel as hp
    from hyper_parallel.checkpoint import save
    from torch import nn

    from torch.distributed.device_mesh import init_device_mesh

    init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    model = hp.fully_shard(nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
    with tempfile.TemporaryDirectory() as folder:
        path = [folder]
        dist.broadcast_object_list(path)
        save({"model": model.state_dict()}, checkpoint_id=path[0] + "/ckpt")
        dist.barrier()
    return process_state()


def test_each_call_starts_from_a_reset_process_state():
    filled = run_on_ranks(2, _fill_process_state)[0]
    assert filled["collective_counts"] > 0 and filled["cached_save_plans"] == 1, filled
    assert filled["test_process_groups"] >= 1, filled
    assert run_on_ranks(2, process_state) == [dict.fromkeys(filled, 0)] * 2
