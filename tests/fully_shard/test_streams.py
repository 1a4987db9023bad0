"""The stream/event design of fully_shard, checked on CPU through a recording Streams.

On CPU the real streams are no-ops (results are those of the other tests); here a recording
implementation stands in for CUDA's, and the test checks where fully_shard issues each
collective and the order of the waits around it.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.core.fully_shard import collectives
from hyper_parallel.platform import CpuStreams, get_platform
from hyper_parallel.platform import platform as platform_module
from tests.fully_shard._helpers import global_batch, lm_loss, tiny_llama
from tests.fully_shard.recording_streams import RecordingStreams
from tests.multirank import run_on_ranks


def _recorded(hsdp: bool, run, reshard_after_forward=None, recorder=None, **shard_kwargs):
    """Shard a tiny llama (root + 2 blocks) with a recording Streams (``recorder``, else a new
    one) and collectives that log the stream they are issued on, and return the log of
    ``run(model, batch)``."""
    streams = recorder or RecordingStreams()
    originals = {name: getattr(collectives, name) for name in ("all_gather", "reduce_scatter", "all_reduce")}

    def logged(name):
        def call(*args, **kwargs):
            host_async = args[3] if len(args) > 3 else kwargs["async_op"]
            streams.log.append((name, streams.current, "host async" if host_async else "stream ordered"))
            # (the gloo collective underneath stays asynchronous: the test runs on CPU ranks)
            return originals[name](*args[:3], True, **{k: v for k, v in kwargs.items() if k != "async_op"})
        return call

    mesh = (hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp
            else hp.init_device_mesh("cpu", (dist.get_world_size(),)))
    with mock.patch.object(platform_module, "_STREAMS", streams), \
            mock.patch.multiple(collectives, **{n: logged(n) for n in originals}):
        assert get_platform().streams() is streams
        torch.manual_seed(0)
        model = tiny_llama()
        for block in model.layers.values():
            hp.fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, **shard_kwargs)
        hp.fully_shard(model, mesh=mesh, **shard_kwargs)
        run(model, global_batch(0).chunk(dist.get_world_size())[dist.get_rank()])
    return streams.log


def _train_step(model, batch):
    lm_loss(model, batch).backward()


def _check(log, hsdp: bool):
    counts = {}
    for i, entry in enumerate(log):
        if entry[0] not in ("all_gather", "reduce_scatter", "all_reduce"):
            continue
        counts[entry[0]] = counts.get(entry[0], 0) + 1
        stream = entry[0]
        assert entry[1] == stream, f"{entry[0]} issued on {entry[1]}, not its own stream: {log}"
        if stream == "all_reduce":  # it waits for its reduce-scatter instead (test below)
            continue
        # The side stream waited for the compute stream before this collective was issued.
        waits = [e for e in log[:i] if e[0] == "wait_for_current" and e[1] == stream]
        assert waits and waits[-1][2] == "compute", log
    # 3 groups: 5 all-gathers (2 blocks again in backward), 3 reduce-scatters (+3 all-reduces for HSDP)
    assert counts == {"all_gather": 5, "reduce_scatter": 3, **({"all_reduce": 3} if hsdp else {})}, counts
    # The all-gather stream waits for the compute stream once, at the root's pre-forward before
    # the first all-gather; the step's other all-gathers add no wait (no false dependency on
    # the compute queued since). Each reduce-scatter waits (its input was just written on the
    # compute stream).
    ag_waits = [i for i, e in enumerate(log) if e[0] == "wait_for_current" and e[1] == "all_gather"]
    first_ag = next(i for i, e in enumerate(log) if e[0] == "all_gather")
    assert len(ag_waits) == 1 and ag_waits[0] < first_ag, log
    assert sum(e[0] == "wait_for_current" and e[1] == "reduce_scatter" for e in log) == 3, log
    # Each all-gather is issued in stream order (no host-async Work whose process-group stream
    # the events would not cover) and followed by an event on its stream that the compute
    # stream waits for before the copy-out; the gathered buffer is then handed back to the
    # all-gather stream, which waits for that copy-out before it allocates again.
    assert all(e[2] == "stream ordered" for e in log if e[0] == "all_gather"), log
    assert [e for e in log if e[0] == "record_event" and e[1] == "all_gather"].__len__() == 5, log
    compute_waits = [e for e in log if e[0] == "wait_event" and e[1] == "all_gather"]
    assert len(compute_waits) == 5 and all(e[2] == "compute" for e in compute_waits), log
    assert sum(e == ("free_after_use", "all_gather", "compute") for e in log) == 5, log
    for i, entry in enumerate(log):
        if entry[0] == "all_gather":
            assert ("reclaim", "all_gather", "all_gather") in log[max(0, i - 3):i], (i, log)
    # Reduce-scatters and all-reduces are issued in stream order too (NCCL would otherwise run
    # them on the process group's own normal-priority stream), each followed by an event on its
    # stream that the compute stream waits for before it reads the result.
    reductions = [i for i, e in enumerate(log) if e[0] in ("reduce_scatter", "all_reduce")]
    assert all(log[i][2] == "stream ordered" for i in reductions), log
    assert all(log[i + 1] == ("record_event", log[i][0]) for i in reductions), log
    compute_waits = [e for e in log if e[0] == "wait_event" and e[1] in ("reduce_scatter", "all_reduce")
                     and e[2] == "compute"]
    assert len(compute_waits) == len(reductions), log
    return True


def _fsdp():
    return _check(_recorded(False, _train_step), hsdp=False)


def _hsdp():
    return _check(_recorded(True, _train_step), hsdp=True)


def test_collectives_on_side_streams_fsdp():
    assert all(run_on_ranks(2, _fsdp, timeout=120))


def test_collectives_on_side_streams_hsdp():
    assert all(run_on_ranks(4, _hsdp, timeout=120))


def _hsdp_all_reduce_stream(offload: bool):
    streams = RecordingStreams()
    policy = {"offload_policy": hp.CPUOffloadPolicy()} if offload else {}
    log = _recorded(True, _train_step, recorder=streams, **policy)
    scatters = [i for i, e in enumerate(log) if e[0] == "reduce_scatter"]
    all_reduces = [i for i, e in enumerate(log) if e[0] == "all_reduce"]
    assert len(scatters) == len(all_reduces) == 3, log
    waits_on = {i: streams.waited[i] for i, e in enumerate(log) if e[0] == "wait_event"}
    host_copies = [i for i, e in enumerate(log)  # (not the end of backward's event, which the host waits for)
                   if e == ("record_host_event", "reduce_scatter") and log[i + 1][0] != "synchronize"]
    assert len(host_copies) == (3 if offload else 0), log
    for j, (rs, ar) in enumerate(zip(scatters, all_reduces)):
        rs_event, ar_event = ("event", "reduce_scatter", rs + 2), ("event", "all_reduce", ar + 2)
        assert log[ar][1] == "all_reduce" and log[rs + 1] == ("record_event", "reduce_scatter"), log
        # The all-reduce stream was ordered after its group's reduce-scatter event, and only that.
        ordering = [i for i, e in enumerate(log[rs:ar], rs)
                    if (e[0] == "wait_event" and e[2] == "all_reduce") or e[:2] == ("wait_for_current", "all_reduce")]
        assert [waits_on.get(i) for i in ordering] == [rs_event], (j, ordering, log)
        # The gradient consumers (the compute stream, then the optimizer) wait for the all-reduce,
        # once; the next group's reduce-scatter is issued before that wait, so its stream (which
        # waits for the compute stream) is not ordered after this all-reduce.
        consumed = [i for i, event in waits_on.items() if event == ar_event]
        assert len(consumed) == 1 and log[consumed[0]][2] == "compute", (j, log)
        if j + 1 < len(scatters):
            assert scatters[j + 1] < consumed[0], (j, log)
        if offload:  # the copy to host memory follows the all-reduce
            copy = host_copies[j]
            assert consumed[0] < copy and ("wait_for_current", "reduce_scatter", "compute") in log[consumed[0]:copy]
    return True


def _hsdp_all_reduce_after_a_partial_sum():
    """A backward without all-reduce leaves partial sums, added to the next reduce-scatter's
    result on the compute stream: that all-reduce waits for the compute stream instead."""
    streams = RecordingStreams()

    def run(model, batch):
        model.set_requires_all_reduce(False)
        _train_step(model, batch)
        model.set_requires_all_reduce(True)
        streams.log.clear()
        _train_step(model, batch)
    log = _recorded(True, run, recorder=streams)
    scatters = [i for i, e in enumerate(log) if e[0] == "reduce_scatter"]
    all_reduces = [i for i, e in enumerate(log) if e[0] == "all_reduce"]
    assert len(scatters) == len(all_reduces) == 3, log
    for rs, ar in zip(scatters, all_reduces):
        ordering = [e for e in log[rs:ar] if e[:2] == ("wait_for_current", "all_reduce") or e[-1] == "all_reduce"]
        assert ordering == [("wait_for_current", "all_reduce", "compute")], (ordering, log)
    return True


def test_hsdp_all_reduce_on_its_own_stream_after_its_reduce_scatter():
    """The HSDP all-reduce runs on the all-reduce stream, ordered after its group's
    reduce-scatter event: the next group's reduce-scatter (intra-node) overlaps it
    (inter-node), as FSDP2's separate all-reduce stream allows; gradient consumers and CPU
    offload copies wait for it."""
    assert all(run_on_ranks(4, _hsdp_all_reduce_stream, False, timeout=120))
    assert all(run_on_ranks(4, _hsdp_all_reduce_stream, True, timeout=120))
    assert all(run_on_ranks(4, _hsdp_all_reduce_after_a_partial_sum, timeout=120))


def _ordering_of_each_step(log):
    """Per step (split at the first all-gather after a reduce-scatter), what the all-gather
    stream was last ordered after: ``("current",)`` (the compute stream) or ``("event", <stream
    the event was recorded on>)``."""
    orders, ordering, new_step = [], None, True
    for entry in log:
        if entry[0] == "wait_for_current" and entry[1] == "all_gather":
            ordering = ("current",)
        elif entry[0] == "wait_event" and entry[2] == "all_gather":
            ordering = ("event", entry[1])
        elif entry[0] == "reduce_scatter":
            new_step = True
        elif entry[0] == "all_gather" and new_step:
            orders.append(ordering)
            new_step = False
    return orders


def _post_optim_event():
    def run(model, batch):
        for step in range(3):
            _train_step(model, batch)
            if step == 0:  # an event recorded after the (here omitted) optimizer step
                model.set_post_optim_event(("event", "post_optim", -1))
    # step 1: the current stream; step 2: the user's event instead; step 3: used once, so the
    # current stream again
    assert _ordering_of_each_step(_recorded(False, run)) == [("current",), ("event", "post_optim"), ("current",)]
    return True


def test_post_optim_event_orders_the_next_steps_all_gathers_once():
    assert all(run_on_ranks(2, _post_optim_event, timeout=120))


def _explicit_unshard_and_post_forward_pieces():
    def unshard_then_step(model, batch):
        model.layers["0"].unshard()  # outside a step: nothing has ordered the all-gather stream
        model.layers["0"].reshard()
        _train_step(model, batch)
    log = _recorded(False, unshard_then_step)
    first_ag = next(i for i, e in enumerate(log) if e[0] == "all_gather")
    assert log[first_ag - 2:first_ag] == [("wait_for_current", "all_gather", "compute"),
                                          ("reclaim", "all_gather", "all_gather")], log
    # reshard_after_forward=2 of 4 ranks: forward keeps pieces cut on the compute stream, and
    # the backward all-gather of them waits for the event recorded after the cut
    log = _recorded(False, _train_step, reshard_after_forward=2)
    piece_events = [i for i, e in enumerate(log) if e == ("record_event", "compute")]
    assert len(piece_events) == 2, log  # one per block
    waits = [i for i, e in enumerate(log) if e == ("wait_event", "compute", "all_gather")]
    assert len(waits) == 2 and all(w > p for w, p in zip(waits, piece_events)), log
    return True


def test_explicit_unshard_waits_and_post_forward_pieces_are_ordered():
    assert all(run_on_ranks(4, _explicit_unshard_and_post_forward_pieces, timeout=120))


def test_cpu_streams_are_no_ops():
    streams = CpuStreams()
    with streams.use(streams.all_gather):
        streams.wait_for_current(streams.all_gather)
        assert streams.record_event() is None
        streams.wait_event(None)
        streams.free_after_use(torch.zeros(1), streams.all_gather)
        streams.reclaim(streams.all_gather)
    assert streams.async_collectives  # gloo: the host waits on the Work later


class _FakeStream:
    def __init__(self, name: str):
        self.name, self.waited = name, []

    def wait_event(self, event) -> None:
        self.waited.append(event)


class _FakeEvent:
    def __init__(self, blocking: bool = False):
        self.blocking = blocking

    def record(self, stream) -> None:
        self.stream = stream


class _FakeDeviceModule:
    """Just enough of ``torch.cuda`` for AcceleratorStreams' bookkeeping."""

    def __init__(self):
        self.compute = _FakeStream("compute")

    def Stream(self, priority: int = 0, device=None) -> _FakeStream:
        return _FakeStream("side")

    def Event(self, blocking: bool = False) -> _FakeEvent:
        return _FakeEvent(blocking)

    def current_stream(self, device=None) -> _FakeStream:
        return self.compute


def test_accelerator_streams_free_gathered_buffers_in_the_all_gather_streams_order():
    import weakref

    from hyper_parallel.platform import AcceleratorStreams

    streams = AcceleratorStreams(_FakeDeviceModule())
    assert not streams.async_collectives  # collectives in stream order, covered by events
    gathered = torch.zeros(4)
    alive = weakref.ref(gathered)
    streams.free_after_use(gathered, streams.all_gather)  # the copy-out (compute) read it
    del gathered
    assert alive() is not None  # held: the all-gather stream has not waited for the copy-out
    streams.reclaim(streams.all_gather)
    assert [e.stream.name for e in streams.all_gather.waited] == ["compute"] and alive() is None
    streams.reclaim(streams.all_gather)  # nothing more to wait for
    assert len(streams.all_gather.waited) == 1


def test_events_the_host_waits_for_are_blocking_sync():
    """A host thread waiting for a default CUDA event spins a core; the events it waits for
    (offloaded gradients, checkpoint copies) are created with ``blocking=True``."""
    from hyper_parallel.platform import AcceleratorStreams, Platform
    from hyper_parallel.platform.copy_stream import CopyStream

    module = _FakeDeviceModule()
    streams = AcceleratorStreams(module)
    assert streams.record_host_event().blocking
    assert not streams.record_event().blocking  # waited for by a stream only

    class _FakeCuda(Platform):
        device_module = property(lambda self: module)

    assert CopyStream(_FakeCuda("cuda", "nccl"), torch.device("cuda", 0)).record().blocking
