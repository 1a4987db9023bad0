"""Reads into destinations the reader cannot fill in place: device memory, strided views,
another dtype. Each box is read into a host slab of the staging pool (pinned on
accelerators), or, for a verified read, copied there from the block being checksummed, and
copied into its destination on the copy stream while the next box is read; ``apply_tensor``
runs once a box's copies have completed (and, verified, its chunk's checksum matched), on
the copy stream too, so the caller's wait covers whatever device copy it makes.
"""

from __future__ import annotations

import math
import os
from collections import deque
from typing import Any, Deque, List, NamedTuple, Optional, Sequence

import torch

from hyper_parallel.core.distributed_checkpoint._fileio import flat_bytes, read_exact
from hyper_parallel.core.distributed_checkpoint.format.geometry import BoxGeometry
from hyper_parallel.core.distributed_checkpoint.planner import LoadPlanner, ReadItem
from hyper_parallel.core.distributed_checkpoint.host_memory.staging_buffers import (
    Slab,
    SlabWindow,
    StagingBuffers,
    check_copy_device,
    process_staging_buffers,
    return_host_memory,
)
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.copy_stream import CopyStream, wait_event

_ALIGN = 64  # boxes start cache-line aligned in a slab (and aligned for any dtype view)


def read_box(fd: int, into: torch.Tensor, box: BoxGeometry, chunk_offset: int, itemsize: int, path: str) -> None:
    """Read ``box`` of the row-major chunk stored at byte ``chunk_offset`` into the contiguous
    host tensor ``into``: one read when the box is contiguous, else one per contiguous run.

    Runs, never the bytes between them: ranks that split a chunk read each stored byte once
    in total. A syscall per run costs ~3 us; reading the gaps would cost their bytes on every
    rank that needs the chunk.
    """
    view = memoryview(flat_bytes(into))
    if box.contiguous:
        read_exact(fd, view, chunk_offset + box.first * itemsize, path)
        return
    run_bytes, pread = box.run * itemsize, os.preadv
    for i, start in enumerate(box.run_starts()):
        part, at = view[i * run_bytes:(i + 1) * run_bytes], chunk_offset + start * itemsize
        if pread(fd, [part], at) != run_bytes:
            read_exact(fd, part, at, path)  # a short read: finish it, or name the truncation


class _Copy(NamedTuple):
    """A copy in flight from ``slab`` (None: a buffer of its own) into a destination."""

    done: Any  # the copy's event (None: completed)
    slab: Optional[Slab]
    buffer: Optional[torch.Tensor]  # keeps the source bytes alive until the copy ran
    apply: Optional[ReadItem]  # the box whose last copy this is: apply_tensor after it
    dest: torch.Tensor


class BounceReads:
    """One reader thread's bounce buffers, drawn from a load's shared ``window`` of slabs.

    Built in the caller's thread (its copy stream is ordered after the caller's current
    stream of ``device``), used by one reader thread (with ``device`` current there), and
    after :meth:`finish`, :meth:`make_current_wait` in the caller's thread again.

    A reader that holds a slab never waits for the pool: when the window or the budget is
    used up it reuses its oldest slab, so the readers of one load cannot wait on each other.
    """

    def __init__(self, pool: StagingBuffers, window: SlabWindow, planner: LoadPlanner, device: torch.device) -> None:
        self._pool, self._window, self._planner, self.device = pool, window, planner, device
        self._stream = CopyStream(get_platform(), device)
        self._stream.after_current_work()  # destinations may still be in use by queued work
        self._slabs: Deque[Slab] = deque()  # in order of use; the last one is being filled
        self._copies: Deque[_Copy] = deque()
        self._own_buffers = 0  # pinned buffers of their own (boxes bigger than a slab) used so far

    def read(self, fd: int, path: str, chunk_offset: int, sizes: Sequence[int], item: ReadItem, dest: torch.Tensor,
             dtype: torch.dtype) -> None:
        """Read box ``item`` of the chunk of ``sizes`` stored at ``chunk_offset`` into ``dest``,
        in slab-sized groups of rows."""
        check_copy_device(self._stream, dest, item.storage_index.fqn)
        lengths, offsets, itemsize = tuple(item.lengths), tuple(item.storage_offsets), dtype.itemsize
        rows = lengths[0] if lengths else 1
        row_bytes = math.prod(lengths[1:]) * itemsize
        per_slab = max(1, self._pool.slab_bytes // max(row_bytes, 1))
        for first in range(0, rows, per_slab):
            n = min(per_slab, rows - first)
            part = (n,) + lengths[1:] if lengths else ()
            nbytes = math.prod(part) * itemsize
            slab, buffer = self._space(nbytes)
            box = BoxGeometry(sizes, ((offsets[0] + first,) + offsets[1:]) if lengths else (), part)
            read_box(fd, buffer, box, chunk_offset, itemsize, path)
            target = dest.narrow(0, first, n) if lengths else dest
            with self._stream.active():
                target.copy_(buffer.view(dtype).view(part), non_blocking=True)
            last = first + n >= rows
            self._copies.append(_Copy(self._stream.record(), slab, buffer, item if last else None, dest))

    def copy(self, source: torch.Tensor, target: torch.Tensor, key: str) -> None:
        """Copy the host tensor ``source`` (a view of a block buffer that is refilled once this
        returns) into ``target`` (``key``'s, of the same shape): into slabs first, in
        slab-sized groups of rows, then on the copy stream."""
        check_copy_device(self._stream, target, key)
        row_bytes = math.prod(source.shape[1:]) * source.element_size()
        per_slab = max(1, self._pool.slab_bytes // max(row_bytes, 1))
        for first in range(0, source.shape[0], per_slab):
            part = source[first:first + per_slab]
            slab, buffer = self._space(part.numel() * part.element_size())
            staged = buffer.view(part.dtype).view(part.shape)
            staged.copy_(part)
            with self._stream.active():
                target[first:first + per_slab].copy_(staged, non_blocking=True)
            self._copies.append(_Copy(self._stream.record(), slab, buffer, None, target))

    def after_current_work(self) -> None:
        """Order the copies issued from now on after the work queued so far on the calling
        thread's current stream (e.g. a send still reading the memory they overwrite)."""
        self._stream.after_current_work()

    def apply_after_copies(self, item: ReadItem, dest: torch.Tensor) -> None:
        """``apply_tensor(item, dest)`` once the copies issued so far have completed."""
        self._copies.append(_Copy(self._stream.record(), None, None, item, dest))

    def _space(self, nbytes: int):
        """``nbytes`` of host memory: the rest of the current slab, a new or the oldest slab,
        or (bigger than a slab) a buffer of its own."""
        if nbytes > self._pool.slab_bytes:
            self._own_buffers += 1
            return None, get_platform().pinned_host_buffer(nbytes)
        slab = self._slabs[-1] if self._slabs else None
        at = 0 if slab is None else -(-slab.used // _ALIGN) * _ALIGN
        if slab is None or at + nbytes > slab.buffer.numel():
            slab, at = self._next_slab(), 0
        slab.used = at + nbytes
        return slab, slab.buffer[at:at + nbytes]

    def _next_slab(self) -> Slab:
        slab = self._pool.try_acquire(self._window) if self._slabs else self._pool.acquire(self._window, self._drain)
        if slab is None:
            slab = self._slabs.popleft()  # the oldest: reuse it once its copies are done
            while any(copy.slab is slab for copy in self._copies):
                self._retire()
        slab.used = 0
        self._slabs.append(slab)
        return slab

    def _retire(self) -> None:
        copy = self._copies.popleft()
        wait_event(copy.done)
        if copy.apply is not None:
            with self._stream.active():  # a copy apply_tensor makes is covered by make_current_wait
                self._planner.apply_tensor(copy.apply, copy.dest)

    def _drain(self) -> None:
        while self._copies:
            self._retire()

    def finish(self) -> None:
        """Wait for every copy, apply the remaining boxes and give the slabs back (also after
        a failure: the copies still in flight complete before their slabs go back)."""
        try:
            self._drain()
        finally:
            self._copies.clear()
            try:
                wait_event(self._stream.record())
            finally:
                while self._slabs:
                    self._pool.give_back(self._window, self._slabs.popleft())
                return_host_memory(self._own_buffers)  # the copies holding them are gone
                self._own_buffers = 0

    def make_current_wait(self) -> None:
        """In the caller's thread, after :meth:`finish`: order its later work on the device
        after the copies."""
        self._stream.make_current_wait()


def load_bounces(planner: LoadPlanner, readers: int = 1) -> List[BounceReads]:
    """The bounce buffers of one load's ``readers`` reader threads: the process's staging
    buffers, one window shared by them (``sync_window_bytes``), copies on the caller's current
    device. Call in the caller's thread (its device and stream are per thread)."""
    pool = process_staging_buffers()
    window, device = pool.window(snapshot=False), get_platform().current_device()
    return [BounceReads(pool, window, planner, device) for _ in range(readers)]
