"""Chunk reads through two reused block buffers (or straight into plain memory):

- checked reads: a stored chunk read whole, block by block, its crc32 computed on a helper
  thread while the next block (of this chunk or the next one) is read (the crc and the reads
  both release the GIL); a chunk's check, and what follows it, runs once its crc is known:
  after the first block of the next chunk was read, or at :meth:`BlockReads.settle`;
- row reads: the rows of a chunk that a box with many small pieces lies in, read in a few
  large reads and copied out in memory, instead of one syscall per piece.

From the block buffers the box a rank needs is copied to its destination (any device, any
strides) while the helper checksums the block.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, List, NamedTuple, Optional, Sequence

import torch

from hyper_parallel.core.distributed_checkpoint._fileio import flat_bytes, read_exact
from hyper_parallel.core.distributed_checkpoint.checksum import crc32
from hyper_parallel.core.distributed_checkpoint.planner import ReadItem
from hyper_parallel.core.distributed_checkpoint.resharding import narrow, numel

BLOCK_BYTES = 8 << 20
"""Bytes read (and checksummed) at a time."""


class _PendingCheck(NamedTuple):
    """A chunk read whole whose crc32 is still being computed."""

    crc: Future
    then: Callable[[int], None]  # called with the chunk's crc32


class _BoxCopy(NamedTuple):
    """How a box of a chunk is copied out of blocks of the chunk's rows."""

    length: int  # the chunk's bytes
    block: int  # bytes per block: whole rows
    first_byte: int  # where the box's first row starts in the chunk
    end_byte: int  # where its last row ends
    use: Callable  # use(start, view): copy the box's part of the block at chunk byte ``start``


class BlockReads:
    """One reader thread's block reads. Call :meth:`settle` after the last read (it runs
    the last chunk's check) and :meth:`close` in any case."""

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        self._block = block_bytes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hyper_parallel-verify")
        self._buffers: List[torch.Tensor] = []
        self._turn = 0  # which buffer the next block goes to: never the one being checksummed
        self._pending: Optional[_PendingCheck] = None

    def read_into(self, fd: int, into, offset: int, path: str, then: Callable[[int], None]) -> None:
        """Read ``len(into)`` bytes at ``offset`` into the buffer ``into``; ``then(crc32)``
        runs once their crc32 is known (``into`` must stay alive until then)."""
        view = memoryview(into).cast("B")
        self._read(fd, offset, len(view), self._block, lambda start, n: view[start:start + n], None, path, then)

    def read_box(self, fd: int, offset: int, sizes: Sequence[int], item: ReadItem, dest: torch.Tensor,
                 dtype: torch.dtype, path: str, then: Callable[[int], None]) -> None:
        """Read the row-major chunk of ``sizes`` stored at ``offset`` whole, copying the box
        ``item.storage_offsets``/``item.lengths`` of it into ``dest``; ``then(crc32)`` runs
        once the chunk's crc32 is known."""
        copier = self._box_copier(sizes, item, dest, dtype)
        self._read(fd, offset, copier.length, copier.block, self._next_buffer, copier.use, path, then)

    def read_rows(self, fd: int, offset: int, sizes: Sequence[int], item: ReadItem, dest: torch.Tensor,
                  dtype: torch.dtype, path: str) -> None:
        """Copy the box ``item.storage_offsets``/``item.lengths`` of the chunk of ``sizes``
        stored at ``offset`` into ``dest``, reading only the rows (along dim 0) it lies in,
        unchecked."""
        copier = self._box_copier(sizes, item, dest, dtype)
        if self._pending is not None:
            wait([self._pending.crc])  # the helper may still checksum a block buffer
        for at in range(copier.first_byte, copier.end_byte, copier.block):
            view = self._next_buffer(at, min(copier.block, copier.end_byte - at))
            read_exact(fd, view, offset + at, path)
            copier.use(at, view)

    def _box_copier(self, sizes: Sequence[int], item: ReadItem, dest: torch.Tensor, dtype: torch.dtype) -> _BoxCopy:
        starts, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        if not sizes:  # a scalar: one row of one element
            sizes, starts, lengths, dest = (1,), (0,), (1,), dest.reshape(1)
        row_bytes = numel(sizes[1:]) * dtype.itemsize
        length = sizes[0] * row_bytes
        block = max(1, self._block // max(row_bytes, 1)) * row_bytes
        if length:
            self._host_buffers(block)
        first, count = starts[0], lengths[0]

        def use(start: int, view) -> None:
            row = start // row_bytes
            lo, hi = max(row, first), min(row + len(view) // row_bytes, first + count)
            if lo < hi:
                rows = torch.from_numpy(view).view(dtype).view((len(view) // row_bytes,) + tuple(sizes[1:]))
                part = narrow(rows, (lo - row,) + starts[1:], (hi - lo,) + lengths[1:])
                with torch.no_grad():
                    dest.narrow(0, lo - first, hi - lo).copy_(part)

        return _BoxCopy(length, block, first * row_bytes, (first + count) * row_bytes, use)

    def settle(self) -> None:
        """Run the pending check of the last chunk read."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.then(pending.crc.result())

    def close(self) -> None:
        """Stop the helper (after the crc it may be computing) and free the buffers."""
        self._pool.shutdown(wait=True)
        self._pending, self._buffers = None, []

    def _host_buffers(self, nbytes: int) -> None:
        if not self._buffers or self._buffers[0].numel() < nbytes:
            if self._pending is not None:
                wait([self._pending.crc])  # it may still be reading an old buffer
            self._buffers = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(2)]

    def _next_buffer(self, start: int, nbytes: int):
        self._turn ^= 1
        return flat_bytes(self._buffers[self._turn][:nbytes])

    def _read(self, fd: int, offset: int, length: int, block: int, place: Callable, use: Optional[Callable],
              path: str, then: Callable[[int], None]) -> None:
        """Read ``length`` bytes in blocks into ``place(start, n)``. The crc of each block runs on
        the helper while ``use(start, block)`` runs and the next block is read; one crc at a
        time, so ``place`` may alternate between two buffers."""
        crc, running = 0, None  # running: the crc of the bytes so far, being computed
        for start in range(0, length, block):
            view = place(start, min(block, length - start))
            read_exact(fd, view, offset + start, path)
            if start == 0:
                self.settle()  # the previous chunk's crc ran while this block was read
            if running is not None:
                crc = running.result()
            running = self._pool.submit(crc32, view, crc)
            if use is not None:
                use(start, view)
        if running is None:  # no bytes: nothing to overlap with
            self.settle()
            running = self._pool.submit(crc32, b"", 0)
        self._pending = _PendingCheck(running, then)
