"""The staging buffers: bounded, reusable host slabs for saves (their copy stages) and loads
(bounced boxes), each byte copied once.

A CPU "device" exercises the accelerator code path: an async save copies host tensors
through the slabs exactly as it copies device tensors (the copy stream and its events are
no-ops on CPU), and loads into destinations the reader cannot fill in place bounce through
the same slabs.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import resource
import threading
import weakref
import zlib
from types import SimpleNamespace

import pytest
import torch

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.host_memory.staging_buffers import StagingBuffers
from hyper_parallel.platform import Platform
from hyper_parallel.platform import platform as platform_module
from hyper_parallel.platform.platform import _clear_cuda_error
from hyper_parallel.platform.copy_stream import CopyStream
from tests.checkpoint.helpers import distribute_state, full_state, load_and_check
from tests.checkpoint.helpers import FailingStagingPlanner, FullDiskWriter
from tests.multirank import run_on_ranks

SLAB, WINDOW, BUDGET = 4096, 8192, 16384


@pytest.fixture
def small_slabs():
    """The process pool with 4 KiB slabs, a 8 KiB sync window and a 16 KiB budget."""
    pool = hdcp.staging_buffers()
    before = dict(slab_bytes=pool.slab_bytes, budget_bytes=pool.budget_bytes, sync_window_bytes=pool.sync_window_bytes)
    hdcp.wait_for_pending_save()
    pool.configure(slab_bytes=SLAB, budget_bytes=BUDGET, sync_window_bytes=WINDOW)
    pool.release()
    yield pool
    hdcp.wait_for_pending_save()
    pool.configure(**before)
    pool.release()


def _state(seed: int = 0):
    """~60 KB: one tensor spanning many slabs, small ones sharing a slab, a plain value."""
    g = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(64, 100, generator=g, dtype=torch.float64),
            "small": {f"b{i}": torch.randn(3, generator=g) for i in range(20)},
            "ints": torch.arange(1000, dtype=torch.int64) * (seed + 1),
            "flags": torch.tensor([True, False, True]), "step": 7 + seed}


def _clone(state):
    return {k: _clone(v) if isinstance(v, dict) else v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in state.items()}


def _blank(state):
    return {k: _blank(v) if isinstance(v, dict) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1
            for k, v in state.items()}


def _assert_equal(actual, expected):
    for key, value in expected.items():
        if isinstance(value, dict):
            _assert_equal(actual[key], value)
        elif isinstance(value, torch.Tensor):
            assert torch.equal(actual[key], value), key
        else:
            assert actual[key] == value, key


def _mutate(state):
    with torch.no_grad():
        for value in state.values():
            if isinstance(value, dict):
                _mutate(value)
            elif isinstance(value, torch.Tensor) and value.dtype != torch.bool:
                value.add_(1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("thread_count", [1, 2])
def test_async_save_larger_than_the_budget_is_exact_and_bounded(tmp_path, small_slabs, thread_count):
    state = _state()
    expected = _clone(state)
    writer = hdcp.FileSystemWriter(str(tmp_path / "ckpt"), thread_count=thread_count)
    start = small_slabs.allocations
    future = hdcp.async_save(state, storage_writer=writer, no_dist=True)
    _mutate(state)  # the tail still in the slabs was copied: it must not see this
    future.result(timeout=30)
    assert small_slabs.nbytes <= BUDGET and small_slabs.allocations - start <= BUDGET // SLAB
    assert small_slabs.in_use == 0
    target = _blank(expected)
    hdcp.load(target, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True, verify=True)
    _assert_equal(target, expected)


class _GatedWriter(hdcp.FileSystemWriter):
    """Starts writing only once the test opens the gate (after its in-place updates)."""

    def __init__(self, path, gate):
        super().__init__(path)
        self.gate = gate

    def execute_write(self, plan, planner):
        assert self.gate.wait(30)
        return super().execute_write(plan, planner)


@pytest.mark.timeout(60)
def test_async_save_snapshots_host_tensors_before_returning(tmp_path, small_slabs):
    small_slabs.configure(slab_bytes=SLAB, budget_bytes=None, sync_window_bytes=WINDOW)
    state, gate = _state(), threading.Event()
    expected = _clone(state)
    future = hdcp.async_save(state, storage_writer=_GatedWriter(str(tmp_path / "ckpt"), gate), no_dist=True)
    _mutate(state)  # nothing is written yet: only the staged copy can hold the old values
    gate.set()
    future.result(timeout=30)
    target = _blank(expected)
    hdcp.load(target, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    _assert_equal(target, expected)


def test_sync_save_of_host_tensors_copies_nothing(tmp_path, small_slabs):
    state, start = _state(), small_slabs.allocations
    metadata = hdcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    assert small_slabs.allocations == start and small_slabs.nbytes == 0  # written from their own memory
    crcs = {index.fqn: info.checksum for index, info in metadata.storage_data.items()}
    assert crcs["big"] == zlib.crc32(state["big"].numpy().tobytes())
    assert crcs["small.b3"] == zlib.crc32(state["small"]["b3"].numpy().tobytes())


def test_slabs_are_reused_across_saves_and_released_on_request(tmp_path, small_slabs):
    start = small_slabs.allocations
    hdcp.async_save(_state(), checkpoint_id=str(tmp_path / "a"), no_dist=True).result(timeout=30)
    allocations = small_slabs.allocations
    assert allocations > start and small_slabs.nbytes == (allocations - start) * SLAB
    hdcp.async_save(_state(1), checkpoint_id=str(tmp_path / "b"), no_dist=True).result(timeout=30)
    assert small_slabs.allocations == allocations
    small_slabs.release()
    assert small_slabs.nbytes == 0
    hdcp.async_save(_state(2), checkpoint_id=str(tmp_path / "c"), no_dist=True).result(timeout=30)
    assert small_slabs.allocations > allocations
    target = _blank(_state())
    hdcp.load(target, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    _assert_equal(target, _state(2))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failure", ["staging", "writer"])
def test_a_failure_on_either_side_stops_both_and_frees_the_slabs(tmp_path, small_slabs, failure):
    path = str(tmp_path / "ckpt")
    kwargs = (dict(planner=FailingStagingPlanner()) if failure == "staging"
              else dict(storage_writer=FullDiskWriter(path)))
    with pytest.raises((RuntimeError, OSError), match="simulated"):
        hdcp.async_save(_state(), checkpoint_id=path, no_dist=True, **kwargs).result(timeout=30)
    hdcp.wait_for_pending_save()
    assert small_slabs.in_use == 0
    assert not hdcp.is_checkpoint(path)
    hdcp.save(_state(), checkpoint_id=path, no_dist=True)  # the pool still works
    assert hdcp.is_checkpoint(path)


class _CopyStreamSpy:
    """Which ``apply_tensor`` calls of non-contiguous destinations ran with the copy stream
    active in their thread (there, a device copy they make is covered by the caller's wait)."""

    def __init__(self, monkeypatch) -> None:
        self.inside, self.applies = threading.local(), []
        active, apply = CopyStream.active, hdcp.StandardLoadPlanner.apply_tensor
        spy = self

        @contextlib.contextmanager
        def spied_active(stream):
            with active(stream):
                spy.inside.on = True
                try:
                    yield
                finally:
                    spy.inside.on = False

        def spied_apply(planner, item, tensor):
            if not tensor.is_contiguous():
                spy.applies.append(getattr(spy.inside, "on", False))
            return apply(planner, item, tensor)

        monkeypatch.setattr(CopyStream, "active", spied_active)
        monkeypatch.setattr(hdcp.StandardLoadPlanner, "apply_tensor", spied_apply)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
def test_loads_into_strided_destinations_bounce_through_a_bounded_window(tmp_path, small_slabs, monkeypatch,
                                                                         verify, threads):
    """Destinations not filled in place (device memory on an accelerator; here strided views
    and another dtype) take one path, checked or not, with one or several reader threads:
    pinned slabs and the copy stream, applied with the copy stream active."""
    state, start = _state(), small_slabs.allocations
    hdcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    target = _blank(state)
    target["big"] = torch.zeros(100, 64, dtype=torch.float64).t()  # not contiguous: cannot read in place
    target["ints"] = torch.zeros(1000, 2, dtype=torch.int64)[:, 1]
    spy = _CopyStreamSpy(monkeypatch)
    reader = hdcp.FileSystemReader(str(tmp_path / "ckpt"), verify=verify, thread_count=threads)
    hdcp.load(target, storage_reader=reader, no_dist=True)
    _assert_equal(target, state)
    assert 0 < small_slabs.allocations - start <= WINDOW // SLAB and small_slabs.in_use == 0
    assert spy.applies and all(spy.applies), spy.applies


def _reshard_with_small_slabs(path):
    hdcp.staging_buffers().configure(slab_bytes=64, budget_bytes=None, sync_window_bytes=128)
    try:
        hdcp.save(distribute_state(full_state(), "shard1"), checkpoint_id=path)
        return load_and_check(path, ["fsdp", "shard1"])
    finally:
        hdcp.staging_buffers().configure(slab_bytes=32 << 20, budget_bytes=None, sync_window_bytes=256 << 20)


def test_resharding_loads_through_bounce_slabs_on_2_ranks(tmp_path):
    assert all(run_on_ranks(2, _reshard_with_small_slabs, str(tmp_path / "ckpt"), timeout=120))


PAGE = resource.getpagesize()


class _RegisteringPlatform(Platform):
    """A CUDA platform whose host registration is recorded instead of calling the CUDA runtime,
    and refused where the runtime would refuse it (a page registered twice, error 712) or where
    the pages are not the buffer's own (page-aligned whole pages); with ``fail``, every
    registration fails. Buffers of the caching host allocator and the emptying of its cache
    are recorded too."""

    def __init__(self, device_type: str = "cuda", fail: bool = False) -> None:
        super().__init__(device_type=device_type, backend="nccl" if device_type == "cuda" else "hccl")
        object.__setattr__(self, "fail", fail)
        object.__setattr__(self, "registered", {})  # address -> bytes, while registered
        object.__setattr__(self, "cached", [])  # weak references to the caching allocator's buffers
        object.__setattr__(self, "emptied", [])  # per emptying of the host cache: were they all freed

    def pin_memory_available(self) -> bool:
        return True

    def host_register(self, address: int, nbytes: int) -> None:
        if self.fail:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with cudaError 2")
        assert address % PAGE == 0 and nbytes % PAGE == 0 and nbytes > 0, (address, nbytes)
        for other, size in self.registered.items():
            assert address + nbytes <= other or other + size <= address, "a page registered twice (712)"
        self.registered[address] = nbytes

    def host_unregister(self, address: int) -> None:
        del self.registered[address]

    def cached_pinned_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.cached.append(weakref.ref(buffer))
        return buffer

    def empty_host_cache(self) -> None:
        gc.collect()
        self.emptied.append(all(ref() is None for ref in self.cached))


def test_pinned_buffers_are_unregistered_when_their_memory_is_freed():
    platform = _RegisteringPlatform()
    buffer = platform.pinned_host_buffer(4096)
    assert platform.registered == {buffer.data_ptr(): 4096}
    view = buffer[100:200].view(torch.int32)  # e.g. a piece still being copied
    del buffer
    gc.collect()
    assert len(platform.registered) == 1  # a view still uses the pages
    del view
    gc.collect()
    assert platform.registered == {}


def test_released_slabs_give_their_pinned_pages_back(monkeypatch):
    """Slabs are pinned by host registration, so release() really unlocks them (memory from
    pin_memory=True stays with torch's caching host allocator for the life of the process)."""
    platform = _RegisteringPlatform()
    monkeypatch.setattr(sys.modules[StagingBuffers.__module__], "get_platform", lambda: platform)
    pool = StagingBuffers(slab_bytes=SLAB, budget_bytes=BUDGET, sync_window_bytes=WINDOW)
    window = pool.window(snapshot=True)
    slabs = [pool.acquire(window, lambda: None) for _ in range(BUDGET // SLAB)]
    assert len(platform.registered) == BUDGET // SLAB and all(n == SLAB for n in platform.registered.values())
    for slab in slabs:
        pool.give_back(window, slab)
    del slabs, slab
    gc.collect()
    assert len(platform.registered) == BUDGET // SLAB  # free slabs stay pinned for the next save
    pool.release()
    gc.collect()
    assert platform.registered == {} and pool.nbytes == 0
    assert platform.emptied == []  # nothing came from the caching host allocator: no cache to empty


def test_pinned_buffers_register_whole_pages_of_their_own():
    """Small buffers (the 16 KiB slabs of the GPU test, a bounce buffer of a few bytes) each
    register page-aligned whole pages inside their own allocation: two of them never share a
    page, which the CUDA runtime would refuse (error 712)."""
    platform = _RegisteringPlatform()
    sizes = (1, 100, PAGE, PAGE + 1, 5000, 16 << 10, 16 << 10, 16 << 10, 3 * PAGE - 8)
    buffers = [platform.pinned_host_buffer(n) for n in sizes]
    assert len(platform.registered) == len(sizes)
    for i, (buffer, n) in enumerate(zip(buffers, sizes)):
        buffer.fill_(i)
        size = platform.registered[buffer.data_ptr()]
        assert buffer.numel() == n and size == -(-n // PAGE) * PAGE
        storage = buffer.untyped_storage()
        assert storage.data_ptr() <= buffer.data_ptr() and buffer.data_ptr() + size <= storage.data_ptr() + storage.nbytes()
    assert [int(b[0]) for b in buffers] == list(range(len(sizes)))  # none overlaps another
    del buffers, buffer, storage
    gc.collect()
    assert platform.registered == {}


def test_a_failed_registration_falls_back_to_the_caching_allocator(monkeypatch):
    monkeypatch.setattr(platform_module, "_CACHED_PINNING", False)
    platform = _RegisteringPlatform(fail=True)
    assert not platform.pinned_memory_cached()
    with pytest.warns(RuntimeWarning, match="caching host allocator"):
        buffer = platform.pinned_host_buffer(5000)
    assert buffer.numel() == 5000 and len(platform.cached) == 1 and platform.registered == {}
    assert platform.pinned_memory_cached()  # release() now empties the host cache


class _FailingCudart:
    def cudaHostRegister(self, address: int, nbytes: int, flags: int) -> int:
        return 712


def test_a_failed_cuda_registration_clears_the_runtime_error(monkeypatch):
    """cudaHostRegister's error stays latched in the runtime (the next kernel launch would
    raise it): host_register clears it before raising, and the buffer falls back."""
    cleared = []
    monkeypatch.setattr(platform_module, "_CACHED_PINNING", False)
    monkeypatch.setattr(platform_module, "_clear_cuda_error", lambda: cleared.append(True))
    platform = _RegisteringPlatform()
    monkeypatch.setattr(_RegisteringPlatform, "device_module", property(lambda self: SimpleNamespace(cudart=_FailingCudart)))
    monkeypatch.delattr(_RegisteringPlatform, "host_register")  # the real one, on the failing runtime
    with pytest.warns(RuntimeWarning, match="cudaError 712"):
        buffer = platform.pinned_host_buffer(100)
    assert cleared == [True] and buffer.numel() == 100 and len(platform.cached) == 1
    _clear_cuda_error()  # the real one: no CUDA runtime loaded here, nothing to clear


def test_release_empties_the_host_cache_where_pinned_memory_is_cached(monkeypatch):
    """NPU: pinned slabs come from the caching host allocator, which keeps them once dropped;
    release() drops them, then empties that cache."""
    platform = _RegisteringPlatform(device_type="npu")
    assert platform.pinned_memory_cached()
    monkeypatch.setattr(sys.modules[StagingBuffers.__module__], "get_platform", lambda: platform)
    pool = StagingBuffers(slab_bytes=SLAB, budget_bytes=BUDGET, sync_window_bytes=WINDOW)
    window = pool.window(snapshot=True)
    slabs = [pool.acquire(window, lambda: None) for _ in range(BUDGET // SLAB)]
    assert len(platform.cached) == BUDGET // SLAB and platform.registered == {}
    for slab in slabs:
        pool.give_back(window, slab)
    del slabs, slab
    assert platform.emptied == []  # free slabs are kept for the next save
    pool.release()
    assert platform.emptied == [True]  # once every slab was dropped
    pool.release()  # nothing left to drop: no emptying
    pool.configure(slab_bytes=SLAB, budget_bytes=BUDGET, sync_window_bytes=WINDOW)
    assert platform.emptied == [True]


def test_a_load_empties_the_host_cache_after_buffers_bigger_than_a_slab(tmp_path, monkeypatch):
    """NPU: a box row bigger than a slab is read through a pinned buffer of its own, which the
    caching host allocator keeps once dropped: the load empties that cache when it finishes."""
    from hyper_parallel.core.distributed_checkpoint.host_memory import bounce
    from tests.checkpoint.helpers import BOX_COLS, BOX_ROWS, AppliedBoxes, box_read

    platform, host = _RegisteringPlatform(device_type="npu"), bounce.get_platform()
    monkeypatch.setattr(bounce, "get_platform", lambda: platform)
    monkeypatch.setattr(bounce, "CopyStream", lambda _, device: CopyStream(host, device))  # copies on CPU
    monkeypatch.setattr(sys.modules[StagingBuffers.__module__], "get_platform", lambda: platform)
    pool = StagingBuffers(slab_bytes=BOX_COLS * 8 // 2, budget_bytes=4096, sync_window_bytes=4096)
    path = str(tmp_path / "chunk.bin")
    expected = torch.arange(BOX_ROWS * BOX_COLS, dtype=torch.float64).view(BOX_ROWS, BOX_COLS)
    expected.numpy().tofile(path)
    planner = AppliedBoxes()
    reader = bounce.BounceReads(pool, pool.window(snapshot=False), planner, torch.device("cpu"))
    dest = torch.zeros(BOX_ROWS, BOX_COLS, dtype=torch.float64)
    fd = os.open(path, os.O_RDONLY)
    try:
        reader.read(fd, path, 0, (BOX_ROWS, BOX_COLS), box_read("t"), dest, torch.float64)
        reader.finish()
    finally:
        os.close(fd)
    assert torch.equal(dest, expected) and planner.applied == ["t"]
    assert len(platform.cached) == BOX_ROWS  # one own buffer per row
    assert platform.emptied == [True]  # once, after every own buffer was dropped
