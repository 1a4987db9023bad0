"""Streams and events for overlapping collectives with compute, behind the platform layer.

fully_shard issues its all-gathers on one side stream, its reduce-scatters on another and
its HSDP all-reduces on a third, so that on an accelerator the next group's all-gather runs
while the current group computes, and a group's all-reduce (inter-node, typically) while the
next group's reduce-scatter (intra-node) runs (the FSDP2 design). On CPU every operation here is a no-op: gloo collectives
and CPU kernels run in issue order, and the CPU path stays exactly as without streams.

Ordering rules the callers follow (see docs/fully_shard.md, "Streams"):

- before issuing on a side stream, :meth:`Streams.wait_for_current` makes the side stream
  wait for what the compute stream has queued (the data it reads was written there);
- the compute stream waits for a side stream's work with :meth:`Streams.wait_event` on an
  event recorded there (or with ``Work.wait()``, which orders the current stream after the
  collective) before it reads the result;
- a tensor allocated on one stream and read on another is either held by the in-flight
  record until the reading stream is ordered after the read, or handed back with
  :meth:`Streams.free_after_use` and dropped once its stream waited for that use
  (:meth:`Streams.reclaim`), so the caching allocator does not hand its memory out early and
  reuses it in stream order (FSDP2's way; ``record_stream`` would let the CPU run ahead and
  the all-gather stream allocate afresh for every group issued).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, ContextManager, Dict, List, Optional, Tuple

import torch


class Streams(ABC):
    """The side streams of one process and the stream/event operations on them.

    Attributes:
        all_gather: the stream all-gathers (and their copy-in casts) are issued on.
        reduce_scatter: the stream reduce-scatters are issued on.
        all_reduce: the stream HSDP all-reduces (and all-reduce hooks) are issued on, after
            their group's reduce-scatter event: not behind the next group's reduce-scatter.
    """

    all_gather: Any
    reduce_scatter: Any
    all_reduce: Any
    # True: collectives are issued with ``async_op=True`` and the host waits on their Work
    # later (CPU, gloo: the only way to overlap them with compute). False: issued in stream
    # order on the side stream (accelerators: the collective runs on the current stream, an
    # event recorded after it covers it, and what it reads and writes is freed and reused in
    # that stream's order, FSDP2's way; a process group's own internal stream would not be).
    async_collectives: bool

    @abstractmethod
    def use(self, stream: Any) -> ContextManager[None]:
        """Make ``stream`` the current stream inside the ``with`` block."""

    @abstractmethod
    def wait_for_current(self, stream: Any) -> None:
        """Make ``stream`` wait for the work queued so far on the current stream."""

    @abstractmethod
    def record_event(self) -> Optional[Any]:
        """An event marking the work queued so far on the current stream."""

    @abstractmethod
    def wait_event(self, event: Optional[Any]) -> None:
        """Make the current stream wait for ``event``."""

    @abstractmethod
    def record_host_event(self) -> Optional[Any]:
        """Like :meth:`record_event`, for an event the host will wait for (:meth:`synchronize`):
        a blocking-sync event, so the waiting thread sleeps instead of spinning a core."""

    @abstractmethod
    def synchronize(self, event: Optional[Any]) -> None:
        """Block the calling host thread until ``event`` (from :meth:`record_host_event`) completed."""

    @abstractmethod
    def free_after_use(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor``, allocated on ``stream``, was last used by the current stream: keep it
        referenced until :meth:`reclaim` orders ``stream`` after that use."""

    @abstractmethod
    def reclaim(self, stream: Any) -> None:
        """Before ``stream`` allocates again: make it wait for the last uses of the tensors
        handed to :meth:`free_after_use` for it, and drop them (their memory is then reused
        in ``stream``'s order; at most one round of them is ever held)."""

    def hold_for_collective(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """What the in-flight record of an asynchronous collective that reads ``tensor`` must
        keep referenced until the collective is waited for: ``tensor`` itself (a caching
        allocator would otherwise hand its memory to the compute stream while the side stream
        still reads it; FSDP2 holds its reduce-scatter input the same way)."""
        return tensor


class CpuStreams(Streams):
    """CPU: one implicit in-order stream; nothing to do."""

    all_gather = None
    reduce_scatter = None
    all_reduce = None
    async_collectives = True

    def use(self, stream: Any) -> ContextManager[None]:
        # Ours are None; a user's torch.cpu.Stream (set_all_reduce_hook) becomes current.
        return contextlib.nullcontext() if stream is None else torch.cpu.stream(stream)

    def wait_for_current(self, stream: Any) -> None:
        pass

    def record_event(self) -> Optional[Any]:
        return None

    def wait_event(self, event: Optional[Any]) -> None:
        pass

    def record_host_event(self) -> Optional[Any]:
        return None

    def synchronize(self, event: Optional[Any]) -> None:
        pass

    def free_after_use(self, tensor: torch.Tensor, stream: Any) -> None:
        pass

    def reclaim(self, stream: Any) -> None:
        pass

    def hold_for_collective(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        # Nothing: no caching allocator or second stream, and the process group's Work keeps
        # what its collective still reads (gloo's reduce-scatter reads a copy of its input
        # made at issue), so holding the input too would only keep its memory resident.
        return None


class AcceleratorStreams(Streams):
    """CUDA / NPU streams and events through the device module (``torch.cuda``, ``torch.npu``).

    Args:
        device_module: the accelerator's torch module.
        priority: of the all-gather and reduce-scatter streams; FSDP2 gives them high
            priority (-1) so their kernels are scheduled ahead of queued compute. The all-reduce
            stream has the default priority, as FSDP2's.
    """

    async_collectives = False

    def __init__(self, device_module: Any, priority: int = -1):
        self._module = device_module
        self.all_gather = device_module.Stream(priority=priority)
        self.reduce_scatter = device_module.Stream(priority=priority)
        self.all_reduce = device_module.Stream()
        self._used: Dict[Any, List[Tuple[torch.Tensor, Any]]] = {}  # stream -> (tensor, event of its last use)

    def use(self, stream: Any) -> ContextManager[None]:
        return self._module.stream(stream)

    def wait_for_current(self, stream: Any) -> None:
        stream.wait_stream(self._module.current_stream())

    def record_event(self) -> Optional[Any]:
        event = self._module.Event()
        event.record(self._module.current_stream())
        return event

    def wait_event(self, event: Optional[Any]) -> None:
        if event is not None:
            self._module.current_stream().wait_event(event)

    def record_host_event(self) -> Optional[Any]:
        event = self._module.Event(blocking=True)
        event.record(self._module.current_stream())
        return event

    def synchronize(self, event: Optional[Any]) -> None:
        if event is not None:
            event.synchronize()

    def free_after_use(self, tensor: torch.Tensor, stream: Any) -> None:
        self._used.setdefault(stream, []).append((tensor, self.record_event()))

    def reclaim(self, stream: Any) -> None:
        for _, event in self._used.pop(stream, ()):
            stream.wait_event(event)
