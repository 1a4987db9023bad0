"""How long fully_shard keeps the buffers its side-stream work reads, and where the host waits,
checked on CPU with the recording streams of test_streams.py and weak references.

On an accelerator a tensor allocated on the compute stream and read by a collective on a side
stream must stay referenced until the compute stream has waited for that collective (NCCL in
stream order holds no reference; the caching allocator would hand the memory to the compute
stream's next kernels), and no longer than that. The collectives here run synchronously on a
copy of their input, so nothing but fully_shard's own records can keep a buffer alive.
"""

from __future__ import annotations

import weakref
from typing import Dict, List
from unittest import mock

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.core.fully_shard import collectives
from hyper_parallel.core.fully_shard.param_group import HSDPParamGroup
from hyper_parallel.platform import platform as platform_module
from tests.fully_shard._helpers import global_batch, lm_loss, tiny_llama
from tests.fully_shard.recording_streams import RecordingStreams
from tests.multirank import run_on_ranks


class _Harness:
    """Recording streams, synchronous collectives (no Work holds a buffer) and a tiny llama
    sharded per block and at the root."""

    def __init__(self, mesh, **shard_kwargs):
        self.streams = RecordingStreams()
        self.reduce_inputs: Dict[int, weakref.ref] = {}  # id(reduce-scatter output) -> its input
        self.reduced_ptrs: List[int] = []
        originals = {name: getattr(collectives, name) for name in ("all_gather", "reduce_scatter", "all_reduce")}

        def synchronous(name):
            def call(output, *args, **_):  # async_op, positional or keyword: dropped
                args = args[:1 if name == "all_reduce" else 2]
                if name == "reduce_scatter":
                    self.reduce_inputs[id(output)] = weakref.ref(args[0])
                    self.reduced_ptrs.append(output.data_ptr())
                self.streams.log.append((name, self.streams.current))
                if name != "all_reduce":  # gloo's worker thread may hold its input a while after
                    args = (args[0].clone(), *args[1:])  # the wait: it must not keep ours alive
                return originals[name](output, *args, async_op=False)
            return call

        self._patches = [mock.patch.object(platform_module, "_STREAMS", self.streams),
                         mock.patch.multiple(collectives, **{n: synchronous(n) for n in originals})]
        for patch in self._patches:
            patch.start()
        torch.manual_seed(0)
        self.model = tiny_llama()
        for block in self.model.layers.values():
            hp.fully_shard(block, mesh=mesh, **shard_kwargs)
        hp.fully_shard(self.model, mesh=mesh, **shard_kwargs)
        self.batch = global_batch(0).chunk(dist.get_world_size())[dist.get_rank()]

    def close(self) -> None:
        for patch in reversed(self._patches):
            patch.stop()


def _post_forward_pieces_held_until_the_copy_out():
    """reshard_after_forward=2 of 4 ranks: the pieces kept after forward (cut on the compute
    stream) are read by the backward all-gather; an all-gather issued early (explicit
    ``unshard(async_op=True)``, or a backward prefetch) must keep them until
    ``wait_for_unshard`` has made the compute stream wait for it."""
    harness = _Harness(hp.init_device_mesh("cpu", (4,)), reshard_after_forward=2)
    try:
        block = harness.model.layers["0"]
        loss = lm_loss(harness.model, harness.batch)
        group = block._state.group
        pieces = [weakref.ref(p) for p in group._post_forward.pieces]
        handle = block.unshard(async_op=True)
        held = [r() is not None for r in pieces]
        mark = len(harness.streams.log)
        handle.wait()
        waited = ("wait_event", "all_gather", "compute") in harness.streams.log[mark:]
        freed = [r() is None for r in pieces]
        loss.backward()
        return all(held), waited, all(freed)
    finally:
        harness.close()


def test_post_forward_pieces_live_until_the_compute_stream_waited_for_their_all_gather():
    for held, waited, freed in run_on_ranks(4, _post_forward_pieces_held_until_the_copy_out, timeout=120):
        assert held, "the pieces were dropped while their all-gather was in flight"
        assert waited, "the compute stream did not wait for the all-gather"
        assert freed, "the pieces outlived the copy-out"


def _hsdp_reduce_scatter_input_dropped_before_the_all_reduce():
    """HSDP: once the compute stream has waited for a group's reduce-scatter, its input (the
    group's unsharded-size gradient) is not held while the all-reduce is in flight."""
    harness = _Harness(hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    alive_during_all_reduce: List[bool] = []
    original = HSDPParamGroup.finish_all_reduce

    def finish_all_reduce(group):
        for item in group._all_reducing:
            alive_during_all_reduce.append(harness.reduce_inputs[id(item.output)]() is not None)
        return original(group)

    try:
        with mock.patch.object(HSDPParamGroup, "finish_all_reduce", finish_all_reduce):
            lm_loss(harness.model, harness.batch).backward()
        return alive_during_all_reduce
    finally:
        harness.close()


def test_hsdp_drops_the_reduce_scatter_input_once_the_reduce_scatter_is_done():
    for alive in run_on_ranks(4, _hsdp_reduce_scatter_input_dropped_before_the_all_reduce, timeout=120):
        assert len(alive) == 3 and not any(alive), alive  # 3 groups, none held


def _offload_copies_waited_once():
    """CPU offload: each reduced gradient is copied to host memory without blocking on the
    reduce-scatter stream, and the host waits for the copies once, at the end of backward; the
    copies' device sources are dropped as the compute stream waits for them."""
    harness = _Harness(hp.init_device_mesh("cpu", (2,)), offload_policy=hp.CPUOffloadPolicy())
    copies, alive_at_wait = [], []
    original_to = torch._C.TensorBase.to
    synchronize = harness.streams.synchronize

    def counted_synchronize(event):  # (on CPU the host copy is the source itself: count the records)
        groups = [m._state.group for m in harness.model.modules() if isinstance(m, hp.FSDPModule)]
        alive_at_wait.append(sum(item.source is not None for g in groups for item in g.offloads._copies))
        synchronize(event)

    def to(tensor, *args, **kwargs):
        if tensor.data_ptr() in harness.reduced_ptrs and "cpu" in (*args, kwargs.get("device")):
            copies.append((len(harness.streams.log), harness.streams.current, kwargs.get("non_blocking", False)))
        return original_to(tensor, *args, **kwargs)

    try:
        lm_loss(harness.model, harness.batch).backward()  # binds the shards (CPU: not pinned)
        for module in harness.model.modules():
            if isinstance(module, hp.FSDPModule):
                module._state.group.pin_memory = True  # as on an accelerator; nothing is re-pinned
        harness.streams.log.clear()
        harness.reduced_ptrs.clear()
        with mock.patch.object(torch.Tensor, "to", to, create=True), \
                mock.patch.object(harness.streams, "synchronize", counted_synchronize):
            lm_loss(harness.model, harness.batch).backward()
        log = harness.streams.log
        waits = [i for i, e in enumerate(log) if e[0] == "synchronize"]
        grads = all(p.grad is not None for p in harness.model.parameters())
        scatters = [i for i, e in enumerate(log) if e[0] == "reduce_scatter"]
        return copies, waits, alive_at_wait, scatters, grads
    finally:
        harness.close()


def test_cpu_offload_copies_on_the_reduce_scatter_stream_and_waits_once():
    for copies, waits, alive, scatters, grads in run_on_ranks(2, _offload_copies_waited_once, timeout=120):
        assert len(copies) == len(scatters) == 3, (copies, scatters)
        # The device sources of earlier copies were dropped once the compute stream waited for
        # them (the next advance of the reduction stages), not held to the end of backward.
        assert len(alive) == 1 and alive[0] <= 1, alive
        assert all(stream == "reduce_scatter" and non_blocking for _, stream, non_blocking in copies), copies
        assert len(waits) == 1 and waits[0] > max(i for i, _, _ in copies), (waits, copies)
        assert grads
