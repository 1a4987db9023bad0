"""Chunk reads through two reused block buffers (or straight into plain memory):

- checked reads: a stored chunk read whole, block by block; each block's crc32 is handed to
  a helper thread and the next block (of this chunk or the next one) is read at once, never
  waiting for it (the crc and the reads both release the GIL). The helper runs the blocks in
  order, advancing each chunk's crc; a chunk's check, and what follows it, runs on the
  reading thread once its crc is known: after a later read finds it done, or at
  :meth:`BlockReads.settle`. Only a block buffer about to be refilled waits for its crc, so
  reads straight into the destination never wait for the checksums (which fall behind
  while the helper waits for a CPU on a busy machine);
- row reads: the rows of a chunk that a box with many small pieces lies in, read in a few
  large reads and copied out in memory, instead of one syscall per piece.

From the block buffers the box a rank needs is copied to its destination while the helper
checksums the block: by ``copy(source, target)``, which for device memory, strided views and
other dtypes stages it in pinned slabs for the copy stream (``BounceReads.copy``), so checked
and unchecked loads reach device memory the same way.
"""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Deque, List, NamedTuple, Optional, Sequence, Tuple

import torch

from hyper_parallel.core.distributed_checkpoint._fileio import flat_bytes, read_exact
from hyper_parallel.core.distributed_checkpoint.format.checksum import crc32
from hyper_parallel.core.distributed_checkpoint.format.geometry import narrow
from hyper_parallel.core.distributed_checkpoint.planner import ReadItem

BLOCK_BYTES = 8 << 20
"""Bytes read (and checksummed) at a time."""

_Copier = Callable[[torch.Tensor, torch.Tensor], None]  # copy(source, target)


def _copy_now(source: torch.Tensor, target: torch.Tensor) -> None:
    target.copy_(source)


class _RunningCrc:
    """A chunk's crc32, advanced block by block on the helper thread (one worker: in order)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def add(self, data) -> None:
        self.value = crc32(data, self.value)


class _PendingCheck(NamedTuple):
    """A chunk read whole whose crc32 is still being computed."""

    last_block: Future  # the helper's task for the chunk's last block
    crc: _RunningCrc  # its value is the chunk's crc32 once ``last_block`` is done
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
        self._checksumming: List[Optional[Future]] = []  # per buffer: the helper's last task on it
        self._turn = 0  # which buffer the next block goes to
        self._pending: Deque[_PendingCheck] = deque()  # in read order

    def read_into(self, fd: int, into, offset: int, path: str, then: Callable[[int], None]) -> None:
        """Read ``len(into)`` bytes at ``offset`` into the buffer ``into``; ``then(crc32)``
        runs once their crc32 is known (``into`` must stay alive until then)."""
        view = memoryview(into).cast("B")
        self._read(fd, offset, len(view), self._block, lambda start, n: (view[start:start + n], None), None,
                   path, then)

    def read_box(self, fd: int, offset: int, sizes: Sequence[int], item: ReadItem, dest: torch.Tensor,
                 dtype: torch.dtype, path: str, then: Callable[[int], None], copy: Optional[_Copier] = None) -> None:
        """Read the row-major chunk of ``sizes`` stored at ``offset`` whole, copying the box
        ``item.storage_offsets``/``item.lengths`` of it into ``dest`` (by ``copy(source,
        target)``, default ``target.copy_(source)``, before the block is refilled);
        ``then(crc32)`` runs once the chunk's crc32 is known."""
        copier = self._box_copier(sizes, item, dest, dtype, copy or _copy_now)
        self._read(fd, offset, copier.length, copier.block, self._next_buffer, copier.use, path, then)

    def read_rows(self, fd: int, offset: int, sizes: Sequence[int], item: ReadItem, dest: torch.Tensor,
                  dtype: torch.dtype, path: str) -> None:
        """Copy the box ``item.storage_offsets``/``item.lengths`` of the chunk of ``sizes``
        stored at ``offset`` into ``dest``, reading only the rows (along dim 0) it lies in,
        unchecked."""
        copier = self._box_copier(sizes, item, dest, dtype)
        for at in range(copier.first_byte, copier.end_byte, copier.block):
            view, _ = self._next_buffer(at, min(copier.block, copier.end_byte - at))
            read_exact(fd, view, offset + at, path)
            copier.use(at, view)

    def _box_copier(self, sizes: Sequence[int], item: ReadItem, dest: torch.Tensor, dtype: torch.dtype,
                    copy: _Copier = _copy_now) -> _BoxCopy:
        starts, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        if not sizes:  # a scalar: one row of one element
            sizes, starts, lengths, dest = (1,), (0,), (1,), dest.reshape(1)
        row_bytes = math.prod(sizes[1:]) * dtype.itemsize
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
                    copy(part, dest.narrow(0, lo - first, hi - lo))

        return _BoxCopy(length, block, first * row_bytes, (first + count) * row_bytes, use)

    def settle(self) -> None:
        """Wait for the crc32 of every chunk read and run their checks, in read order."""
        self._run_checks(wait=True)

    def close(self) -> None:
        """Stop the helper (after the crcs it has left) and free the buffers."""
        self._pool.shutdown(wait=True)
        self._pending.clear()
        self._buffers, self._checksumming = [], []

    def _run_checks(self, wait: bool) -> None:
        """Run the checks of the chunks whose crc32 is known (``wait``: of all of them)."""
        while self._pending and (wait or self._pending[0].last_block.done()):
            check = self._pending.popleft()
            check.last_block.result()  # (re-raises the helper's error)
            check.then(check.crc.value)

    def _host_buffers(self, nbytes: int) -> None:
        if not self._buffers or self._buffers[0].numel() < nbytes:
            # The helper's tasks hold views of the old buffers: they stay alive until checked.
            self._buffers = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(2)]
            self._checksumming = [None, None]

    def _next_buffer(self, start: int, nbytes: int) -> Tuple[object, int]:
        """The other block buffer (once the helper is done with it) and its slot."""
        self._turn ^= 1
        busy = self._checksumming[self._turn]
        if busy is not None:
            busy.result()
        return flat_bytes(self._buffers[self._turn][:nbytes]), self._turn

    def _read(self, fd: int, offset: int, length: int, block: int, place: Callable, use: Optional[Callable],
              path: str, then: Callable[[int], None]) -> None:
        """Read ``length`` bytes in blocks into ``place(start, n)`` (a view and its block buffer's
        slot, or None). Each block's crc runs on the helper while ``use(start, block)`` runs and
        later blocks are read; ``then(crc32)`` runs once the last one's is known."""
        crc, task = _RunningCrc(), None
        for start in range(0, length, block):
            view, slot = place(start, min(block, length - start))
            read_exact(fd, view, offset + start, path)
            task = self._pool.submit(crc.add, view)
            if slot is not None:
                self._checksumming[slot] = task
            if use is not None:
                use(start, view)
            self._run_checks(wait=False)
        if task is None:  # no bytes
            task = self._pool.submit(crc.add, b"")
        self._pending.append(_PendingCheck(task, crc, then))
