"""A save's snapshot: the copy stages that copy a save's tensor chunks into slabs of the
staging buffers (staging_buffers.py) for the writer, chunk by chunk.

[Note: the save's copy stages]
One producer (:meth:`StagedSave.produce`: the caller's thread, or the staging thread of an
async save with ``stage_in_background``) walks the plan's tensor items
in plan order and copies each chunk's bytes into slabs on a side stream, one piece at a time
(a piece never spans two slabs; small chunks share one). The writer's threads consume each
item's pieces in order (:meth:`StagedSave.chunks`): wait for the piece's copy, checksum and
write it, and give its slab space back. The producer blocks while the save's window of slabs
is full, so copying piece i+1 overlaps writing piece i and host memory stays bounded.

- A synchronous save stages with a window of ``sync_window_bytes`` and waits for the write.
  Chunks already in host memory are written from their own memory (no copy at all).
- An async save is a snapshot: every chunk, host ones included, is copied. Its staging is
  complete once the producer is done: with ``budget_bytes=None`` (the default) right after
  the copies; with a budget smaller than the rank's state, once all but the budget has been
  written. ``async_save`` returns then, or right after planning with ``stage_in_background``
  (background.py: the producer then runs on a staging thread, and in-place updates wait
  for it).
- The copy stream is ordered after the caller's queued work when the stages are created
  (``StagedSave(...)``, in the caller's thread: the current device and stream are per
  thread). It is a stream of the caller's current device; a chunk on another accelerator
  device is refused (``check_copy_device``): its copy would not run on that stream.
- Every byte crosses to the host at most once, and is checksummed once, by the writer, on
  the staged bytes.
"""

from __future__ import annotations

import math
import queue
import threading
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.metadata import Metadata, MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from hyper_parallel.core.distributed_checkpoint.host_memory.staging_buffers import Slab, StagingBuffers, check_copy_device
from hyper_parallel.core.distributed_checkpoint.storage import ChunkSource, RankWriteResult, StorageWriter
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.copy_stream import CopyStream, wait_event


class _Piece(NamedTuple):
    """Bytes of one item ready to be written once ``ready`` (the copy's event) completed."""

    data: torch.Tensor  # host uint8 bytes
    slab: Optional[Slab]  # None: ``data`` is the source's own host memory
    ready: Any  # None: nothing in flight
    source: Optional[torch.Tensor]  # keeps a device source alive until its copy has run


class _End(NamedTuple):
    """The item has no more pieces (``error`` set: it never will)."""

    error: Optional[BaseException] = None


class StagedSave(SavePlanner, ChunkSource):
    """One save's copy stages (see [Note: the save's copy stages]). It stands in for the
    planner while writing: planning steps go to the original planner, tensor bytes come
    from :meth:`chunks`, serialised values from planning.

    Life cycle: the writer consumes (in any thread) while :meth:`produce` runs in the
    caller's; the writer's owner calls :meth:`writer_finished` when the writer returned.
    """

    def __init__(self, pool: StagingBuffers, plan: SavePlan, planner: SavePlanner, snapshot: bool) -> None:
        self._pool, self._planner, self.snapshot = pool, planner, snapshot
        self._window = pool.window(snapshot)
        self._tensors = [it for it in plan.items if it.type == WriteItemType.TENSOR]
        self._values = {it.index: planner.get_data(it) for it in plan.items if it.type == WriteItemType.BYTE_IO}
        self._queues: Dict[MetadataIndex, "queue.SimpleQueue"] = {it.index: queue.SimpleQueue() for it in self._tensors}
        self._current: Optional[Slab] = None
        self._lock = threading.Lock()
        self._held: List[Slab] = []  # every slab this save took, until both sides finished
        self._open_sides = 2  # producer and writer
        self._start_writer: Callable[[], None] = lambda: None
        self._stream = CopyStream(get_platform(), get_platform().current_device())
        self._stream.after_current_work()  # the caller's queued work produces what we copy

    # --- planning steps: the original planner's --------------------------------------

    def configure_planner(self, state_dict: Dict[str, Any], **kwargs: Any) -> None:
        self._planner.configure_planner(state_dict, **kwargs)

    def build_local_plan(self) -> SavePlan:
        return self._planner.build_local_plan()

    def build_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        return self._planner.build_global_plan(all_plans)

    def finalize_plan(self, plan: SavePlan) -> SavePlan:
        return self._planner.finalize_plan(plan)

    def known_checksum(self, item: WriteItem) -> Optional[int]:
        """The planner's checksum where the bytes written are the ones it checksummed: not
        for a snapshot, which may be staged after an in-place update (background staging);
        its staged bytes are checksummed as they are written, so a checkpoint verifies."""
        return None if self.snapshot else self._planner.known_checksum(item)

    def get_data(self, item: WriteItem) -> Any:
        """Serialised values as planned; a tensor chunk assembled from its staged pieces
        (for writers that do not stream :meth:`chunks`)."""
        if item.type == WriteItemType.BYTE_IO:
            return self._values[item.index]
        data = torch.cat([piece.clone() for piece in self.chunks(item)])
        td = item.tensor_data
        return data.view(td.dtype).reshape(td.chunk.sizes)

    # --- producer -------------------------------------------------------------------

    def produce(self, start_writer: Callable[[], None]) -> None:
        """Copy every tensor chunk into the staging buffers, in plan order. ``start_writer()`` is
        called the first time the window is full (the writer must drain it from another
        thread); if it never fills, the caller starts the writer afterwards. Returns (or
        raises) once every copy it issued has completed: a snapshot's later in-place updates
        cannot reach them, and a failure gives back no slab a copy still writes into. Runs in
        any thread (the copies were ordered after the creating thread's work). Raises what
        failed; the writer then fails too."""
        self._start_writer = start_writer
        get_platform().use_device(self._stream.device)  # a staging thread starts on device 0
        try:
            for item in self._tensors:
                self._stage_item(item, self._stream)
        except BaseException as exc:
            self.abort(exc)
            raise
        finally:
            try:  # a snapshot's in-place updates after this cannot reach the copies; and no copy
                wait_event(self._stream.record())  # still runs into a slab a failure gives back
            finally:
                self._close_side()

    def _stage_item(self, item: WriteItem, stream: CopyStream) -> None:
        td = item.tensor_data
        with stream.active():  # a copy get_data or contiguous() makes follows the caller's work too
            source = self._planner.get_data(item).detach()
            if tuple(source.shape) != tuple(td.chunk.sizes) or source.dtype != td.dtype:
                raise CheckpointError(f"{item.index.fqn!r} changed shape or dtype between planning and writing")
            check_copy_device(stream, source, item.index.fqn)
            flat = source.contiguous().reshape(-1).view(torch.uint8)
        out = self._queues[item.index]
        if flat.device.type == "cpu" and not self.snapshot:
            out.put(_Piece(flat, None, None, None))  # host memory, written while the caller waits
        else:
            keep = None if flat.device.type == "cpu" else flat
            done, total = 0, math.prod(td.chunk.sizes) * td.dtype.itemsize
            while done < total:
                slab, at, size = self._reserve(total - done)
                target = slab.buffer[at:at + size]
                with stream.active():
                    target.copy_(flat[done:done + size], non_blocking=True)
                out.put(_Piece(target, slab, stream.record(), keep))
                done += size
        out.put(_End())

    def _reserve(self, wanted: int) -> Tuple[Slab, int, int]:
        """Space for up to ``wanted`` bytes in the current slab, or in a new one."""
        with self._lock:
            slab = self._current
            if slab is not None and slab.used < slab.buffer.numel():
                at, size = slab.used, min(wanted, slab.buffer.numel() - slab.used)
                slab.used += size
                slab.pending += 1
                return slab, at, size
            self._current = None
            if slab is not None and slab.pending == 0:
                self._return(slab)
        slab = self._pool.acquire(self._window, self._start_writer)  # may block: outside our lock
        with self._lock:
            self._held.append(slab)
            self._current = slab
            size = min(wanted, slab.buffer.numel())
            slab.used, slab.pending = size, 1
        return slab, 0, size

    # --- consumers ------------------------------------------------------------------

    def chunks(self, item: WriteItem) -> Iterator[torch.Tensor]:
        source = self._queues[item.index]
        while True:
            piece = source.get()
            if isinstance(piece, _End):
                if piece.error is not None:
                    raise piece.error
                return
            try:
                wait_event(piece.ready)
                yield piece.data
            finally:
                self._consumed(piece)

    def _consumed(self, piece: _Piece) -> None:
        if piece.slab is None:
            return
        with self._lock:
            piece.slab.pending -= 1
            if piece.slab.pending == 0 and piece.slab is not self._current:
                self._return(piece.slab)

    def _return(self, slab: Slab) -> None:
        """Under ``_lock``: hand a slab nobody needs back to the pool."""
        if slab in self._held:
            self._held.remove(slab)
            self._pool.give_back(self._window, slab)

    def abort(self, error: BaseException) -> None:
        self._pool.fail(self._window, error)
        for pending in self._queues.values():
            pending.put(_End(error))

    def write_with(self, writer: StorageWriter, plan: SavePlan) -> RankWriteResult:
        """``writer.execute_write(plan, self)``, then mark the writer side finished."""
        try:
            result = writer.execute_write(plan, self)
        except BaseException as exc:
            self.writer_finished(exc)
            raise
        self.writer_finished()
        return result

    def writer_finished(self, error: Optional[BaseException] = None) -> None:
        """The writer returned (``error``: it raised). A producer still running is stopped."""
        self.abort(error or CheckpointError("the writer returned before consuming every staged chunk"))
        self._close_side()

    def _close_side(self) -> None:
        with self._lock:
            self._open_sides -= 1
            if self._open_sides:
                return
            held, self._held, self._current = self._held, [], None
        for slab in held:  # both sides are done: whatever is left is unused now
            self._pool.give_back(self._window, slab)
