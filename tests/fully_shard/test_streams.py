"""The stream/event design of fully_shard, checked on CPU through a recording Streams.

On CPU the real streams are no-ops (results are those of the other tests); here a recording
implementation stands in for CUDA's, and the test checks where fully_shard issues each
collective and the order of the waits around it.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, List, Optional
from unittest import mock

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.core.fully_shard import collectives
from hyper_parallel.platform import CpuStreams, Streams, get_platform
from hyper_parallel.platform import platform as platform_module
from tests.fully_shard._helpers import global_batch, lm_loss, tiny_llama
from tests.multirank import run_on_ranks


class _RecordingStreams(Streams):
    """Logs every operation with the stream current at the time ("compute" outside use())."""

    all_gather = "all_gather"
    reduce_scatter = "reduce_scatter"

    def __init__(self):
        self.current = "compute"
        self.log: List[tuple] = []

    @contextlib.contextmanager
    def _use(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def use(self, stream: Any) -> ContextManager[None]:
        return self._use(stream)

    def wait_for_current(self, stream: Any) -> None:
        self.log.append(("wait_for_current", stream, self.current))

    def record_event(self) -> Optional[Any]:
        self.log.append(("record_event", self.current))
        return ("event", self.current, len(self.log))

    def wait_event(self, event: Optional[Any]) -> None:
        self.log.append(("wait_event", event[1] if event else None, self.current))

    def record_stream(self, tensor: torch.Tensor) -> None:
        self.log.append(("record_stream", self.current))


def _record_one_step(hsdp: bool):
    streams = _RecordingStreams()
    originals = {name: getattr(collectives, name) for name in ("all_gather", "reduce_scatter", "all_reduce")}

    def logged(name):
        def call(*args, **kwargs):
            streams.log.append((name, streams.current))
            return originals[name](*args, **kwargs)
        return call

    mesh = (hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp
            else hp.init_device_mesh("cpu", (dist.get_world_size(),)))
    with mock.patch.object(platform_module, "_STREAMS", streams), \
            mock.patch.multiple(collectives, **{n: logged(n) for n in originals}):
        assert get_platform().streams() is streams
        torch.manual_seed(0)
        model = tiny_llama()
        for block in model.layers:
            hp.fully_shard(block, mesh=mesh)
        hp.fully_shard(model, mesh=mesh)
        lm_loss(model, global_batch(0).chunk(dist.get_world_size())[dist.get_rank()]).backward()
    return streams.log


def _check(log, hsdp: bool):
    kinds = {"all_gather": "all_gather", "reduce_scatter": "reduce_scatter", "all_reduce": "reduce_scatter"}
    counts = {}
    for i, entry in enumerate(log):
        if entry[0] not in kinds:
            continue
        counts[entry[0]] = counts.get(entry[0], 0) + 1
        stream = kinds[entry[0]]
        assert entry[1] == stream, f"{entry[0]} issued on {entry[1]}, not its own stream: {log}"
        # The side stream waited for the compute stream before this collective was issued.
        waits = [e for e in log[:i] if e[0] == "wait_for_current" and e[1] == stream]
        assert waits and waits[-1][2] == "compute", log
    # 3 groups: 5 all-gathers (2 blocks again in backward), 3 reduce-scatters (+3 all-reduces for HSDP)
    assert counts == {"all_gather": 5, "reduce_scatter": 3, **({"all_reduce": 3} if hsdp else {})}, counts
    # Each all-gather is followed by an event on its stream that the compute stream waits for
    # before the copy-out, and the gathered buffer is marked as used by the compute stream.
    assert [e for e in log if e[0] == "record_event" and e[1] == "all_gather"].__len__() == 5, log
    compute_waits = [e for e in log if e[0] == "wait_event" and e[1] == "all_gather"]
    assert len(compute_waits) == 5 and all(e[2] == "compute" for e in compute_waits), log
    assert sum(e == ("record_stream", "compute") for e in log) == 5, log
    # Reduce-scatters and all-reduces record no event: the compute stream orders itself after
    # them with Work.wait() before it sets the gradients.
    assert not [e for e in log if e[0] == "record_event" and e[1] != "all_gather"], log
    return True


def _fsdp():
    return _check(_record_one_step(hsdp=False), hsdp=False)


def _hsdp():
    return _check(_record_one_step(hsdp=True), hsdp=True)


def test_collectives_on_side_streams_fsdp():
    assert all(run_on_ranks(2, _fsdp, timeout=120))


def test_collectives_on_side_streams_hsdp():
    assert all(run_on_ranks(4, _hsdp, timeout=120))


def test_cpu_streams_are_no_ops():
    streams = CpuStreams()
    with streams.use(streams.all_gather):
        streams.wait_for_current(streams.all_gather)
        assert streams.record_event() is None
        streams.wait_event(None)
        streams.record_stream(torch.zeros(1))
