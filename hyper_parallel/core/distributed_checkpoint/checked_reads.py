"""Checked reads: a stored chunk read whole, block by block, its crc32 computed on a helper
thread while the next block is read (the crc and the reads both release the GIL).

A chunk lands either straight in plain memory that holds all of it, or block by block in two
reused host buffers from which the part a rank needs (any box) is copied to its destination
(any device, any strides) while the helper checksums the block.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, List, Optional, Sequence

import torch

from hyper_parallel.core.distributed_checkpoint._fileio import flat_bytes, read_exact
from hyper_parallel.core.distributed_checkpoint.checksum import crc32
from hyper_parallel.core.distributed_checkpoint.planner import ReadItem
from hyper_parallel.core.distributed_checkpoint.resharding import narrow, numel

BLOCK_BYTES = 8 << 20
"""Bytes read (and checksummed) at a time."""


class CheckedReads:
    """One reader thread's checked reads; ``close()`` when done."""

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        self._block = block_bytes
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hyper_parallel-verify")
        self._buffers: List[torch.Tensor] = []

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._buffers = []

    def read_into(self, fd: int, into, offset: int, path: str) -> int:
        """Read ``len(into)`` bytes at ``offset`` into the buffer ``into``; returns their crc32."""
        view = memoryview(into).cast("B")
        return self._read(fd, offset, len(view), self._block, lambda start, n: view[start:start + n], None, path)

    def read_box(self, fd: int, offset: int, sizes: Sequence[int], item: ReadItem, dest: torch.Tensor,
                 dtype: torch.dtype, path: str) -> int:
        """Read the row-major chunk of ``sizes`` stored at ``offset`` whole, copying the box
        ``item.storage_offsets``/``item.lengths`` of it into ``dest``; returns the chunk's crc32."""
        starts, lengths = tuple(item.storage_offsets), tuple(item.lengths)
        if not sizes:  # a scalar: one row of one element
            sizes, starts, lengths, dest = (1,), (0,), (1,), dest.reshape(1)
        row_bytes = numel(sizes[1:]) * dtype.itemsize
        length = sizes[0] * row_bytes
        if length == 0:
            return crc32(b"")
        rows_per_block = max(1, self._block // row_bytes)
        buffers = self._host_buffers(rows_per_block * row_bytes)
        first, count = starts[0], lengths[0]

        def place(start: int, nbytes: int):
            return flat_bytes(buffers[(start // (rows_per_block * row_bytes)) % 2][:nbytes])

        def use(start: int, block) -> None:
            row = start // row_bytes
            lo, hi = max(row, first), min(row + len(block) // row_bytes, first + count)
            if lo >= hi:
                return
            rows = torch.from_numpy(block).view(dtype).view((len(block) // row_bytes,) + tuple(sizes[1:]))
            part = narrow(rows, (lo - row,) + starts[1:], (hi - lo,) + lengths[1:])
            with torch.no_grad():
                dest.narrow(0, lo - first, hi - lo).copy_(part)

        return self._read(fd, offset, length, rows_per_block * row_bytes, place, use, path)

    def _host_buffers(self, nbytes: int) -> List[torch.Tensor]:
        if not self._buffers or self._buffers[0].numel() < nbytes:
            self._buffers = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(2)]
        return self._buffers

    def _read(self, fd: int, offset: int, length: int, block: int, place: Callable,
              use: Optional[Callable], path: str) -> int:
        """Read ``length`` bytes in blocks into ``place(start, n)``; each block's crc runs on
        the helper while ``use(start, block)`` runs and the next block is read. Two blocks in
        flight at most, so ``place`` may alternate between two buffers."""
        crc, pending = 0, None  # type: int, Optional[Future]
        try:
            for start in range(0, length, block):
                view = place(start, min(block, length - start))
                read_exact(fd, view, offset + start, path)
                if pending is not None:
                    crc = pending.result()
                pending = self._pool.submit(crc32, view, crc)
                if use is not None:
                    use(start, view)
            return crc if pending is None else pending.result()
        finally:
            if pending is not None:
                wait([pending])  # never leave the helper reading a buffer that is reused or freed
