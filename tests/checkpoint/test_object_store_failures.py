"""Object-store loads (``object_store/reader.py``, ``forwarding.py``) when one rank fails, and the
paths their bytes take: a rank that fails before or inside the forwarding exchange makes every
rank raise within seconds (no rank left waiting in a receive); forwarded chunks travel in
bounded pieces; destinations not filled in place go through the pinned slabs and the copy
stream, as local loads do.

The 2-rank tests run gloo ranks on CPU (a rank stuck in a receive would wait for gloo's
120 s timeout; these tests give the ranks ``T`` seconds). ``HP_TEST_DEVICE=cuda`` puts the
single-process load's destinations in GPU memory (``benchmarks/gpu_session.sh``).
"""

from __future__ import annotations

import contextlib
import math
import os
import threading

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.object_store import forwarding, store
from hyper_parallel.platform.copy_stream import CopyStream
from tests.checkpoint.helpers import load_and_check, save_layout
from tests.multirank import run_on_ranks

fsspec = pytest.importorskip("fsspec", reason="object storage needs fsspec (pip install 'hyper_parallel[s3]')")

T = 30
DEVICE = os.environ.get("HP_TEST_DEVICE") or "cpu"


# --------------------------------------------------------------- a rank fails, every rank raises

def _rows(placement):
    """One 8 x 6 tensor over 2 ranks: saved by rows, each rank's rows in its own object; loaded
    by columns, so each rank checks (and forwards) the chunk in the object its own rank saved."""
    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    return {"w": distribute_tensor(full if placement is not None else torch.zeros(8, 6), mesh, [placement or Shard(1)])}


def _save_rows(url):
    hdcp.save(_rows(Shard(0)), checkpoint_id=url)


def _load_rows(url, fault=None):
    """Load by columns with ``fault`` on rank 1; (error type, message) or "loaded"."""
    patches = contextlib.ExitStack()
    rank = torch.distributed.get_rank()
    if fault == "unchecked":  # the object changes after its size was checked
        patches.enter_context(_patched(store, "check_object", lambda *args: None))
    elif fault in ("allocating", "staging") and rank == 1:
        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")

        name = "__init__" if fault == "allocating" else "_stage"
        patches.enter_context(_patched(forwarding.Forwarder, name, out_of_memory))
    with patches:
        target = _rows(None)
        try:
            hdcp.load(target, checkpoint_id=url)
        except Exception as exc:  # noqa: BLE001 - the test compares every rank's error
            return type(exc).__name__, str(exc)
    columns = torch.arange(48, dtype=torch.float32).reshape(8, 6)[:, 3 * rank:3 * rank + 3]
    return "loaded" if torch.equal(target["w"].to_local(), columns) else "wrong values"


@contextlib.contextmanager
def _patched(owner, name, value):
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _damage(folder, how):
    name = next(n for n in os.listdir(folder) if n.startswith("__1_") and n.endswith(".safetensors"))
    path = os.path.join(folder, name)
    if how == "deleted":
        os.remove(path)
    else:
        os.truncate(path, os.path.getsize(path) - 8)  # the end of the last chunk
    return name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how, named", [("deleted", "is missing"), ("truncated", "metadata says")])
def test_a_missing_or_truncated_object_fails_every_rank_before_the_exchange(tmp_path, how, named):
    url = f"file://{tmp_path}/step-1"
    run_on_ranks(2, _save_rows, url, timeout=T)
    name = _damage(tmp_path / "step-1", how)
    errors = run_on_ranks(2, _load_rows, url, timeout=T)  # gloo would leave a waiting rank 120 s
    # Only rank 1 fetches from that object; rank 0 learns of it before it waits on rank 1.
    assert errors[1][0] == "CheckpointError" and name in errors[1][1] and named in errors[1][1], errors
    assert errors[0][0] == "CheckpointError", errors
    assert "failed on rank 1 before the forwarding exchange" in errors[0][1] and named in errors[0][1], errors


@pytest.mark.timeout(120)
def test_a_source_that_fails_inside_the_exchange_fails_every_rank_with_its_message(tmp_path):
    url = f"file://{tmp_path}/step-1"
    run_on_ranks(2, _save_rows, url, timeout=T)
    _damage(tmp_path / "step-1", "truncated")
    errors = run_on_ranks(2, _load_rows, url, "unchecked", timeout=T)
    assert errors[1][0] == "CheckpointError" and "is truncated" in errors[1][1], errors
    assert errors[0][0] == "CheckpointError", errors
    assert "rank 1 could not fetch w chunk" in errors[0][1] and "is truncated" in errors[0][1], errors


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault, step", [("allocating", "before the forwarding exchange"),
                                         ("staging", "could not fetch w chunk")])
def test_out_of_device_memory_on_one_rank_fails_every_rank(tmp_path, fault, step):
    url = f"file://{tmp_path}/step-1"
    run_on_ranks(2, _save_rows, url, timeout=T)
    errors = run_on_ranks(2, _load_rows, url, fault, timeout=T)
    assert errors[1][0] == "OutOfMemoryError" and "simulated" in errors[1][1], errors
    assert errors[0][0] == "CheckpointError" and step in errors[0][1], errors
    assert "rank 1" in errors[0][1] and "CUDA out of memory" in errors[0][1], errors
    assert run_on_ranks(2, _load_rows, url, timeout=T) == ["loaded", "loaded"]  # the ranks still work


# ------------------------------------------------------------------------ pieces of a forwarded chunk

@pytest.mark.parametrize("sizes, itemsize, bound", [((11, 6), 2, 16), ((3, 9), 4, 16), ((2, 3, 5), 8, 20),
                                                     ((7,), 4, 8), ((), 8, 4), ((4, 4), 4, 1 << 20)])
def test_pieces_tile_a_chunk_in_byte_order_within_the_bound(sizes, itemsize, bound):
    cut = forwarding.pieces(sizes, itemsize, bound)
    flat = torch.arange(math.prod(sizes)).reshape(sizes)
    at = 0
    for piece in cut:
        assert piece.start == at and piece.end - piece.start <= max(bound, itemsize)
        box = flat[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.lengths))]
        assert torch.equal(box.reshape(-1), torch.arange(piece.start // itemsize, piece.end // itemsize))
        at = piece.end
    assert at == math.prod(sizes) * itemsize
    assert len(cut) == 1 or math.prod(sizes) * itemsize > bound


def _load_in_pieces(url, bound):
    """Resharding load with pieces of at most ``bound`` bytes through 64-byte slabs: (largest
    piece sent, pieces sent, slabs allocated)."""
    pool = hdcp.staging_buffers()
    pool.configure(slab_bytes=64, budget_bytes=None, sync_window_bytes=128)
    sent = []
    real_send = torch.distributed.send

    def send(tensor, dst, *args, **kwargs):
        if tensor.numel() != forwarding.STATUS_BYTES:
            sent.append(tensor.numel() * tensor.element_size())
        return real_send(tensor, dst, *args, **kwargs)

    start = pool.allocations
    try:
        with _patched(forwarding, "PIECE_BYTES", bound), _patched(torch.distributed, "send", send):
            assert load_and_check(url, ["shard1"])  # torch.equal on every tensor
        return max(sent), len(sent), pool.allocations - start
    finally:
        pool.configure(slab_bytes=32 << 20, budget_bytes=None, sync_window_bytes=256 << 20)


@pytest.mark.timeout(120)
def test_chunks_larger_than_the_piece_bound_are_forwarded_in_pieces_exactly(tmp_path):
    url = f"file://{tmp_path}/step-1"
    run_on_ranks(2, save_layout, url, "fsdp", timeout=T)
    results = run_on_ranks(2, _load_in_pieces, url, 16, timeout=T)
    reader = hdcp.FsspecReader(url)
    reader.initialize_reader(None)
    assert max(info.length for info in reader.read_metadata().storage_data.values()
               if info.relative_path.endswith(".safetensors")) > 16  # forwarded (every chunk is) in pieces
    for largest, count, slabs in results:
        assert largest <= 16 and count > 0 and slabs > 0  # each source staged its pieces through slabs


# ------------------------------------------------------------- destinations not filled in place

class _CopyStreamLog:
    """Records the copy stream's operations, and whether each ``apply_tensor`` ran with it active."""

    def __init__(self, monkeypatch) -> None:
        self.ops, self.applied, self.inside = [], [], threading.local()
        log = self

        def recorded(name):
            original = getattr(CopyStream, name)

            def op(stream, *args):
                log.ops.append(name)
                return original(stream, *args)

            monkeypatch.setattr(CopyStream, name, op)

        for name in ("after_current_work", "record", "make_current_wait"):
            recorded(name)
        active, apply = CopyStream.active, hdcp.StandardLoadPlanner.apply_tensor

        @contextlib.contextmanager
        def spied_active(stream):
            log.ops.append("active")
            with active(stream):
                log.inside.on = True
                try:
                    yield
                finally:
                    log.inside.on = False

        def spied_apply(planner, item, tensor):
            log.applied.append((item.storage_index.fqn, getattr(log.inside, "on", False)))
            return apply(planner, item, tensor)

        monkeypatch.setattr(CopyStream, "active", spied_active)
        monkeypatch.setattr(hdcp.StandardLoadPlanner, "apply_tensor", spied_apply)


def _destinations(state):
    """Destinations the reader cannot fill in place: GPU memory with ``HP_TEST_DEVICE=cuda``,
    else strided host views (the same path on CPU)."""
    if DEVICE != "cpu":
        return {k: torch.zeros_like(v, device=DEVICE) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    big = torch.zeros(100, 64, dtype=torch.float64).t()
    ints = torch.zeros(1000, 2, dtype=torch.int64)[:, 1]
    return {"big": big, "ints": ints, "scalar": torch.zeros(()), "step": -1}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
def test_destinations_not_filled_in_place_go_through_the_slabs_and_the_copy_stream(memory_url, monkeypatch, verify):
    g = torch.Generator().manual_seed(0)
    state = {"big": torch.randn(64, 100, generator=g, dtype=torch.float64),
             "ints": torch.arange(1000, dtype=torch.int64), "scalar": torch.tensor(2.5), "step": 7}
    hdcp.save(state, checkpoint_id=memory_url, no_dist=True)
    pool = hdcp.staging_buffers()
    pool.configure(slab_bytes=4096, budget_bytes=None, sync_window_bytes=8192)
    try:
        start = pool.allocations
        log = _CopyStreamLog(monkeypatch)
        target = _destinations(state)
        hdcp.load(target, checkpoint_id=memory_url, no_dist=True, verify=verify)
        for key in ("big", "ints", "scalar"):
            assert torch.equal(target[key].cpu(), state[key]), key
        assert target["step"] == 7
        assert 0 < pool.allocations - start <= 2 and pool.in_use == 0  # bounded by the window
        # Ordered after the caller's work, copied on the stream, waited for by the caller; each
        # box applied with the copy stream active (a device copy it makes is covered by that wait).
        assert log.ops[0] == "after_current_work" and log.ops[-1] == "make_current_wait", log.ops
        assert log.ops.count("active") >= 3 and "record" in log.ops, log.ops
        on_device = DEVICE != "cpu"  # a 0-d host tensor is always plain
        assert sorted(log.applied) == [("big", True), ("ints", True), ("scalar", on_device)], log.applied
    finally:
        pool.configure(slab_bytes=32 << 20, budget_bytes=None, sync_window_bytes=256 << 20)
        pool.release()


def test_plain_host_destinations_are_filled_without_the_slabs(memory_url, monkeypatch):
    state = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    hdcp.save(state, checkpoint_id=memory_url, no_dist=True)
    start = hdcp.staging_buffers().allocations
    log = _CopyStreamLog(monkeypatch)
    target = {"w": torch.zeros(3, 4)}
    hdcp.load(target, checkpoint_id=memory_url, no_dist=True)
    assert torch.equal(target["w"], state["w"]) and log.applied == [("w", False)]
    assert hdcp.staging_buffers().allocations == start and "active" not in log.ops
