"""Chunk reads in pieces, each checksummed as soon as it is read (or straight into plain memory):

- checked reads: a stored chunk read whole, in pieces of ``PIECE_BYTES``; each piece's crc32
  runs on the reading thread right after its read, while the bytes the kernel just copied are
  still in the core's cache, so the checksum is no second pass over memory (ISA-L's crc32 runs
  at ~100 GB/s on cached bytes, ~15 GB/s from memory; ``benchmarks/RESULTS.md``).
  A chunk is read either straight into its destination or, when the rank needs a box of it,
  into one reused block buffer of whole rows from which the box is copied out;
- row reads: the rows of a chunk that a box with many small pieces lies in, read in a few
  large reads and copied out in memory, instead of one syscall per piece.

From the block buffer the box a rank needs is copied to its destination by ``copy(source,
target)``, which for device memory, strided views and other dtypes stages it in pinned slabs
for the copy stream (``BounceReads.copy``), so checked and unchecked loads reach device memory
the same way. The disk keeps reading ahead meanwhile (the kernel's readahead), so checking on
the reading thread costs the disk nothing; several reader threads (``thread_count``) read and
check different chunks at once.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional, Sequence

import torch

from hyper_parallel.core.distributed_checkpoint._fileio import flat_bytes, read_exact
from hyper_parallel.core.distributed_checkpoint.format.checksum import crc32
from hyper_parallel.core.distributed_checkpoint.format.geometry import narrow
from hyper_parallel.core.distributed_checkpoint.planner import ReadItem

BLOCK_BYTES = 8 << 20
"""Bytes of whole rows read into the block buffer before the box is copied out of them."""

PIECE_BYTES = 512 << 10
"""Bytes read (and checksummed) at a time: small enough to stay in a core's L2 cache between
the read and its crc32, large enough that a syscall per piece costs nothing measurable."""

_Copier = Callable[[torch.Tensor, torch.Tensor], None]  # copy(source, target)


def _copy_now(source: torch.Tensor, target: torch.Tensor) -> None:
    target.copy_(source)


def read_checked(fd: int, view: memoryview, offset: int, path: str, crc: int = 0) -> int:
    """Fill ``view`` (bytes) from ``fd`` at ``offset`` piece by piece, returning the crc32 of
    its bytes continued from ``crc``."""
    for start in range(0, len(view), PIECE_BYTES):
        piece = view[start:start + PIECE_BYTES]
        read_exact(fd, piece, offset + start, path)
        crc = crc32(piece, crc)
    return crc


class _BoxCopy(NamedTuple):
    """How a box of a chunk is copied out of blocks of the chunk's rows."""

    length: int  # the chunk's bytes
    block: int  # bytes per block: whole rows
    first_byte: int  # where the box's first row starts in the chunk
    end_byte: int  # where its last row ends
    use: Callable  # use(start, view): copy the box's part of the block at chunk byte ``start``


class BlockReads:
    """One reader thread's block buffer, for reads of boxes of stored chunks. Call
    :meth:`close` after the last read."""

    def __init__(self, block_bytes: int = BLOCK_BYTES) -> None:
        self._block = block_bytes
        self._buffer: Optional[torch.Tensor] = None

    @staticmethod
    def read_into(fd: int, into, offset: int, path: str) -> int:
        """Read ``len(into)`` bytes at ``offset`` into the buffer ``into``; returns their crc32."""
        return read_checked(fd, memoryview(into).cast("B"), offset, path)

    def read_box(self, fd: int, offset: int, sizes: Sequence[int], item: ReadItem, dest: torch.Tensor,
                 dtype: torch.dtype, path: str, copy: Optional[_Copier] = None) -> int:
        """Read the row-major chunk of ``sizes`` stored at ``offset`` whole, copying the box
        ``item.storage_offsets``/``item.lengths`` of it into ``dest`` (by ``copy(source,
        target)``, default ``target.copy_(source)``, before the block buffer is refilled);
        returns the chunk's crc32."""
        copier = self._box_copier(sizes, item, dest, dtype, copy or _copy_now)
        crc = 0
        for start in range(0, copier.length, copier.block):
            view = self._view(min(copier.block, copier.length - start))
            crc = read_checked(fd, memoryview(view), offset + start, path, crc)
            copier.use(start, view)
        return crc

    def read_rows(self, fd: int, offset: int, sizes: Sequence[int], item: ReadItem, dest: torch.Tensor,
                  dtype: torch.dtype, path: str) -> None:
        """Copy the box ``item.storage_offsets``/``item.lengths`` of the chunk of ``sizes``
        stored at ``offset`` into ``dest``, reading only the rows (along dim 0) it lies in,
        unchecked."""
        copier = self._box_copier(sizes, item, dest, dtype)
        for at in range(copier.first_byte, copier.end_byte, copier.block):
            view = self._view(min(copier.block, copier.end_byte - at))
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
        if length and (self._buffer is None or self._buffer.numel() < block):
            self._buffer = torch.empty(block, dtype=torch.uint8)
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

    def _view(self, nbytes: int):
        return flat_bytes(self._buffer[:nbytes])

    def close(self) -> None:
        """Free the block buffer."""
        self._buffer = None
