"""A tensor's stored chunks as one compact table, indexed by offset.

At scale a tensor has one chunk per shard (16,384 ranks: up to 16,384 chunks per tensor), so
the metadata holds the boxes as ``int64`` arrays (``2 * ndim`` numbers per chunk) instead of
one object per chunk, and answers the two questions planning asks without scanning them all:
which chunk starts at given offsets (:meth:`ChunkTable.sizes_at`) and which chunks intersect a
box (:meth:`ChunkTable.overlapping`). Both use one index, built on first use: the chunks sorted
by their start on the dimension with the most distinct starts (the sharded one), searched by
bisection; candidates are then checked on every dimension, so any layout gives exact answers.
"""

from __future__ import annotations

import bisect
from array import array
from dataclasses import dataclass
from typing import Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union, overload


@dataclass(frozen=True, slots=True)
class ChunkStorageMetadata:
    """One stored box of a tensor: global ``offsets`` and ``sizes`` per dim."""

    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]


class _Index(NamedTuple):
    """Chunk positions sorted by their start on ``dim``; ``longest`` is the largest extent on
    ``dim``, so a chunk ending after ``x`` starts after ``x - longest``."""

    dim: int
    starts: array  # sorted starts on ``dim``
    order: array  # chunk position of each entry of ``starts``
    longest: int


class ChunkTable(Sequence[ChunkStorageMetadata]):
    """The chunks of one ``ndim``-dimensional tensor, in insertion (or :meth:`sort`) order.

    A sequence of :class:`ChunkStorageMetadata` (built on access), appendable like a list.
    """

    __slots__ = ("ndim", "_count", "_data", "_index")

    def __init__(self, ndim: int, chunks: Iterable[ChunkStorageMetadata] = ()) -> None:
        self.ndim = ndim
        self._count = 0
        self._data = array("q")  # per chunk: offsets, then sizes
        self._index: Optional[_Index] = None
        self.extend(chunks)

    # ------------------------------------------------------------------ building

    def append_box(self, offsets: Sequence[int], sizes: Sequence[int]) -> None:
        """Add the chunk ``offsets``/``sizes``. Raises ValueError if either has another ndim."""
        if len(offsets) != self.ndim or len(sizes) != self.ndim:
            raise ValueError(f"a chunk of a {self.ndim}-dim tensor has offsets {tuple(offsets)} "
                             f"and sizes {tuple(sizes)}")
        self._data.extend(offsets)
        self._data.extend(sizes)
        self._count += 1
        self._index = None

    def append(self, chunk: ChunkStorageMetadata) -> None:
        self.append_box(chunk.offsets, chunk.sizes)

    def extend(self, chunks: Iterable[ChunkStorageMetadata]) -> None:
        for chunk in chunks:
            self.append_box(chunk.offsets, chunk.sizes)

    def sort(self) -> None:
        """Order the chunks by their offsets."""
        order = sorted(range(self._count), key=self.offsets_of)
        data, width = array("q"), 2 * self.ndim
        for i in order:
            data.extend(self._data[i * width:(i + 1) * width])
        self._data, self._index = data, None

    # ------------------------------------------------------------------ reading

    def offsets_of(self, position: int) -> Tuple[int, ...]:
        start = position * 2 * self.ndim
        return tuple(self._data[start:start + self.ndim])

    def sizes_of(self, position: int) -> Tuple[int, ...]:
        start = position * 2 * self.ndim + self.ndim
        return tuple(self._data[start:start + self.ndim])

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, position: int) -> ChunkStorageMetadata: ...

    @overload
    def __getitem__(self, position: slice) -> List[ChunkStorageMetadata]: ...

    def __getitem__(self, position: Union[int, slice]) -> Union[ChunkStorageMetadata, List[ChunkStorageMetadata]]:
        if isinstance(position, slice):
            return [self[i] for i in range(*position.indices(self._count))]
        if position < 0:
            position += self._count
        if not 0 <= position < self._count:
            raise IndexError(f"chunk {position} of {self._count}")
        return ChunkStorageMetadata(self.offsets_of(position), self.sizes_of(position))

    def __iter__(self) -> Iterator[ChunkStorageMetadata]:
        if self.ndim == 0:
            yield from (ChunkStorageMetadata((), ()) for _ in range(self._count))
            return
        numbers = iter(self._data)
        for row in zip(*[numbers] * (2 * self.ndim)):  # one chunk's offsets and sizes
            yield ChunkStorageMetadata(row[:self.ndim], row[self.ndim:])

    def __contains__(self, chunk: object) -> bool:
        return (isinstance(chunk, ChunkStorageMetadata) and len(chunk.offsets) == self.ndim
                and self.sizes_at(chunk.offsets) == chunk.sizes)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ChunkTable):
            return (self.ndim, self._count, self._data) == (other.ndim, other._count, other._data)
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return f"ChunkTable({list(self)!r})"

    def __reduce__(self):
        return _restore, (self.ndim, self._count, self._data)

    def nbytes(self) -> int:
        """Bytes held by the table's arrays (the index included once built)."""
        index = self._index
        extra = 0 if index is None else (len(index.starts) + len(index.order)) * 8
        return len(self._data) * 8 + extra

    # ------------------------------------------------------------------ queries

    def sizes_at(self, offsets: Optional[Sequence[int]]) -> Optional[Tuple[int, ...]]:
        """Sizes of the (first) chunk starting at ``offsets``, or None if none does (also for
        None or offsets of another ndim)."""
        if offsets is None or len(offsets) != self.ndim:
            return None
        offsets = tuple(offsets)
        for position in self._candidates(offsets, (1,) * self.ndim):
            if self.offsets_of(position) == offsets:
                return self.sizes_of(position)
        return None

    def overlapping(self, offsets: Sequence[int], sizes: Sequence[int]) -> List[int]:
        """Positions, in table order, of the chunks that intersect the box ``offsets``/``sizes``
        in at least one element."""
        found = []
        for position in self._candidates(offsets, sizes):
            base = position * 2 * self.ndim
            if all(max(o, self._data[base + d]) < min(o + s, self._data[base + d] + self._data[base + self.ndim + d])
                   for d, (o, s) in enumerate(zip(offsets, sizes))):
                found.append(position)
        found.sort()
        return found

    def _candidates(self, offsets: Sequence[int], sizes: Sequence[int]) -> Iterable[int]:
        """Chunks whose extent on the index's dim may meet ``[offsets, offsets + sizes)``."""
        if self.ndim == 0:
            return range(self._count)
        index = self._index or self._build_index()
        lo, hi = offsets[index.dim], offsets[index.dim] + sizes[index.dim]
        first = bisect.bisect_right(index.starts, lo - index.longest)
        last = bisect.bisect_left(index.starts, hi)
        return index.order[first:last]

    def _build_index(self) -> _Index:
        width = 2 * self.ndim
        distinct = [len(set(self._data[d::width])) for d in range(self.ndim)]
        dim = max(range(self.ndim), key=distinct.__getitem__)
        starts = self._data[dim::width]
        order = array("q", sorted(range(self._count), key=starts.__getitem__))
        longest = max(self._data[self.ndim + dim::width], default=1) or 1  # (empty chunks)
        self._index = _Index(dim, array("q", (starts[i] for i in order)), order, longest)
        return self._index


def _restore(ndim: int, count: int, data: array) -> ChunkTable:
    table = ChunkTable(ndim)
    table._count, table._data = count, data
    return table
