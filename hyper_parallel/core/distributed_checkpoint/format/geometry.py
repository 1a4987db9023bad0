"""Box geometry: overlaps of global boxes, views of a box, and where a box lies inside a stored
row-major chunk. Plain arithmetic on sizes and offsets (which box a rank holds is
``planning/shards.py``)."""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from hyper_parallel.core.distributed_checkpoint.format.chunk_table import ChunkStorageMetadata


def overlap(
    dest: ChunkStorageMetadata, stored: ChunkStorageMetadata
) -> Optional[Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]]:
    """The common box of two global boxes, or None if they do not intersect.

    Returns ``(dest_offsets, storage_offsets, lengths)``: the box's start relative to each
    chunk and its size.
    """
    dest_offsets, storage_offsets, lengths = [], [], []
    for d_off, d_size, s_off, s_size in zip(dest.offsets, dest.sizes, stored.offsets, stored.sizes):
        lo, hi = max(d_off, s_off), min(d_off + d_size, s_off + s_size)
        if hi <= lo:
            return None
        dest_offsets.append(lo - d_off)
        storage_offsets.append(lo - s_off)
        lengths.append(hi - lo)
    return tuple(dest_offsets), tuple(storage_offsets), tuple(lengths)


def narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """View of ``tensor`` restricted to the box ``offsets``/``lengths``."""
    for dim, (off, length) in enumerate(zip(offsets, lengths)):
        if off != 0 or length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, off, length)
    return tensor


class BoxGeometry:
    """Where a box (``offsets``/``lengths``) of a row-major chunk of ``sizes`` lies, in
    elements from the chunk's start, and the contiguous runs it is made of."""

    def __init__(self, sizes: Tuple[int, ...], offsets: Tuple[int, ...], lengths: Tuple[int, ...]) -> None:
        self.offsets, self.lengths = offsets, lengths
        self.strides = [1] * len(sizes)
        for d in range(len(sizes) - 2, -1, -1):
            self.strides[d] = self.strides[d + 1] * sizes[d + 1]
        self.first = sum(o * s for o, s in zip(offsets, self.strides))
        self.span = sum((n - 1) * s for n, s in zip(lengths, self.strides)) + 1
        self.volume = math.prod(lengths)
        self.contiguous = self.span == self.volume
        # Runs: the box's contiguous pieces, spanning every dim from the last partial one on.
        partial = [d for d, (n, size) in enumerate(zip(lengths, sizes)) if n != size]
        self.run_dim = partial[-1] if partial else 0
        self.run = math.prod(lengths[self.run_dim:])

    def run_starts(self) -> List[int]:
        """Element offset of every run, in the box's row-major order."""
        starts = torch.tensor([self.first], dtype=torch.int64)
        for n, stride in zip(self.lengths[:self.run_dim], self.strides[:self.run_dim]):
            starts = (starts[:, None] + torch.arange(n, dtype=torch.int64) * stride).reshape(-1)
        return starts.tolist()
