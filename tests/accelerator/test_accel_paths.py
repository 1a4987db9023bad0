"""The accelerator paths the CPU suite checks with recording fakes, run on the device itself
(one rank on ``HP_TEST_DEVICE``, as test_on_device.py; on CPU they still run, and check the
CPU side of each path):

- small pinned slabs (16 KiB, a few bytes) registered side by side: no registration fails
  (two sharing a page would fail with error 712, and leave the error latched for the next
  kernel launch), each buffer is pinned;
- a replicated host shard broadcast over the rank's default group (NCCL serves only CUDA):
  through a copy on the device;
- the HSDP all-reduce issued on the platform's all-reduce stream, not the reduce-scatter one.
"""

from __future__ import annotations

import gc
import warnings
from types import SimpleNamespace
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import hyper_parallel as hp
from hyper_parallel.core.distributed_checkpoint.api import _broadcast_replicas
from hyper_parallel.core.fully_shard import collectives
from hyper_parallel.platform import get_platform
from tests.accelerator.test_on_device import DEVICE, _on_ranks, _shard_blocks_and_root, pytestmark  # noqa: F401
from tests.fully_shard._helpers import float64_lm_loss, global_batch, tiny_llama


def _small_pinned_slabs():
    platform = get_platform()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback to the caching allocator warns
        buffers = [platform.pinned_host_buffer(n) for n in [16 << 10] * 8 + [1, 100, 5000]]
    pinned = [b.is_pinned() for b in buffers]
    for i, buffer in enumerate(buffers):
        buffer.fill_(i)
    device = torch.ones(4, device=DEVICE)  # a kernel launch: would raise a latched error
    copies = [b.to(DEVICE, non_blocking=True) for b in buffers]
    exact = all(int(c.min()) == int(c.max()) == i for i, c in enumerate(copies))
    del buffers, copies
    gc.collect()
    float(device.sum())
    return pinned, exact, platform.pinned_memory_cached()


def test_small_pinned_slabs_register_side_by_side():
    pinned, exact, cached = _on_ranks(_small_pinned_slabs)
    assert exact and not cached
    assert all(pinned) if DEVICE == "cuda" else not any(pinned)


def _host_shard_broadcast():
    rows = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    targets = [rows.clone(), rows.clone().t()]  # contiguous, and not
    planner = SimpleNamespace(broadcasts=lambda: [(t, 0, dist.group.WORLD) for t in targets])
    devices = []
    broadcast = dist.broadcast

    def recording(tensor, *args, **kwargs):
        devices.append(tensor.device.type)
        return broadcast(tensor, *args, **kwargs)

    with mock.patch.object(dist, "broadcast", recording):
        _broadcast_replicas(planner)
    return devices, torch.equal(targets[0], rows) and torch.equal(targets[1], rows.t())


def test_a_host_shard_is_broadcast_where_the_group_serves_it():
    devices, exact = _on_ranks(_host_shard_broadcast)
    assert exact and devices == [DEVICE, DEVICE]  # NCCL: a device copy; gloo: in place


def _all_reduce_stream():
    streams, issued_on = get_platform().streams(), []
    all_reduce = collectives.all_reduce

    def recording(*args, **kwargs):
        if DEVICE == "cuda":
            issued_on.append(torch.cuda.current_stream() == streams.all_reduce)
        return all_reduce(*args, **kwargs)

    torch.manual_seed(0)
    mesh = init_device_mesh(DEVICE, (1, 1), mesh_dim_names=("replicate", "shard"))
    model = _shard_blocks_and_root(tiny_llama().to(DEVICE), lambda m: hp.fully_shard(m, mesh=mesh))
    with mock.patch.object(collectives, "all_reduce", recording):
        float64_lm_loss(model, global_batch(0).to(DEVICE)).backward()
    return issued_on, all(p.grad is not None for p in model.parameters())


def test_hsdp_all_reduce_runs_on_the_all_reduce_stream():
    issued_on, grads = _on_ranks(_all_reduce_stream)
    assert grads
    if DEVICE == "cuda":
        assert issued_on and all(issued_on), issued_on
