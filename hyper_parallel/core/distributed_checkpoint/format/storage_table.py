"""Where every stored item lives (``Metadata.storage_data``), held as columns.

A checkpoint has one storage location per stored chunk: 1.7 million for a Llama-8B-shaped
state saved by 16,384 FSDP ranks. One ``MetadataIndex`` + ``StorageInfo`` pair of objects per
location (with the dict entry, about 300 bytes) made them the largest part of the metadata
every rank holds. :class:`StorageTable` keeps each field in an ``array`` (names as ids into
one small table of names; about 90 bytes per 2-D chunk, its hash index included) and builds
the two objects only for the entries a caller reads.
"""

from __future__ import annotations

import collections
from array import array
from collections.abc import ItemsView, ValuesView
from dataclasses import dataclass
from typing import Counter, Dict, Iterable, Iterator, List, Mapping, NamedTuple, Optional, Tuple, Union

__all__ = ["MetadataIndex", "StorageEntry", "StorageInfo", "StorageTable"]


@dataclass(frozen=True, slots=True)
class MetadataIndex:
    """Names one stored item: ``fqn``, plus the chunk's global ``offset`` for tensors.

    ``index`` is None for the copy the reader uses; extra replicas written with
    ``remove_redundancy=False`` get ``index`` 1, 2, ...
    """

    fqn: str
    offset: Optional[Tuple[int, ...]] = None
    index: Optional[int] = None


@dataclass(frozen=True, slots=True)
class StorageInfo:
    """Where an item lives: file (relative to the checkpoint dir), byte range, crc32.

    ``encoding`` is ``"raw"`` for tensor bytes, ``"json"`` or ``"pickle"`` for values.
    """

    relative_path: str
    offset: int
    length: int
    checksum: int
    encoding: str = "raw"


class StorageEntry(NamedTuple):
    """One row of a :class:`StorageTable`: the fields of its ``MetadataIndex`` and ``StorageInfo``."""

    fqn: str
    offset: Optional[Tuple[int, ...]]
    index: Optional[int]
    relative_path: str
    byte_offset: int
    length: int
    checksum: int
    encoding: str


_NONE = -1  # the code of a None ``offset`` (as its ndim) and of a None replica ``index``
_EMPTY = -1  # a free slot of the hash index
# Keys hash as tuples of ints (fqn id, replica code, ndim code, *offsets): unlike str, int
# hashing is not salted per process, so a table sent to another rank keeps its hashes. The
# receiver recomputes them only if its interpreter hashes this probe differently.
_PROBE = (3, _NONE, 2, 4096, 0)


class StorageTable(Mapping[MetadataIndex, StorageInfo]):
    """``MetadataIndex -> StorageInfo`` in insertion order, stored column-wise.

    A read-only ``Mapping`` (each lookup or iteration step builds the objects it returns)
    plus ``__setitem__`` and ``setdefault`` as on a dict; entries are never removed. Lookups
    go through an open-addressing hash index over the rows (amortised O(1)).
    """

    __slots__ = ("_names", "_ids", "_fqn", "_replica", "_ndim", "_at", "_offsets", "_file", "_start",
                 "_length", "_crc", "_encoding", "_hash", "_slots")

    def __init__(self, items: Union[Mapping[MetadataIndex, StorageInfo],
                                    Iterable[Tuple[MetadataIndex, StorageInfo]]] = ()) -> None:
        self._names: List[str] = []  # fqns, file names and encodings, each once
        self._ids: Dict[str, int] = {}
        self._fqn, self._file, self._encoding = array("I"), array("I"), array("I")  # ids into _names
        self._replica = array("q")  # MetadataIndex.index, _NONE for None
        self._ndim = array("h")  # len(MetadataIndex.offset), _NONE for None
        self._at = array("q")  # where the row's offsets start in _offsets
        self._offsets = array("q")
        self._start, self._length, self._crc = array("q"), array("q"), array("I")
        self._hash = array("q")
        self._slots = array("i", [_EMPTY]) * 8
        for index, info in (items.items() if isinstance(items, Mapping) else items):
            self[index] = info

    # ------------------------------------------------------------------ writing

    def insert(self, fqn: str, offset: Optional[Tuple[int, ...]], index: Optional[int], relative_path: str,
               byte_offset: int, length: int, checksum: int, encoding: str = "raw") -> bool:
        """Add the item ``MetadataIndex(fqn, offset, index)`` stored at ``StorageInfo(relative_path,
        byte_offset, length, checksum, encoding)`` unless that key is present already.

        Returns False (and changes nothing) if it was. Raises:
            ValueError: a negative replica ``index``.
        """
        key = self._key(fqn, offset, index, adding=True)
        h = hash(key)
        row, slot = self._probe(key, h)
        if row != _EMPTY:
            return False
        self._append(key, h, slot, offset, relative_path, byte_offset, length, checksum, encoding)
        return True

    def __setitem__(self, index: MetadataIndex, info: StorageInfo) -> None:
        key = self._key(index.fqn, index.offset, index.index, adding=True)
        h = hash(key)
        row, slot = self._probe(key, h)
        if row == _EMPTY:
            self._append(key, h, slot, index.offset, info.relative_path, info.offset, info.length,
                         info.checksum, info.encoding)
        else:
            self._file[row], self._encoding[row] = self._id(info.relative_path), self._id(info.encoding)
            self._start[row], self._length[row], self._crc[row] = info.offset, info.length, info.checksum

    def setdefault(self, index: MetadataIndex, default: StorageInfo) -> StorageInfo:
        """The stored location of ``index``, after adding ``default`` for it if it had none."""
        found = self.get(index)
        if found is None:
            self[index] = default
            return default
        return found

    def _append(self, key: Tuple[int, ...], h: int, slot: int, offset: Optional[Tuple[int, ...]], relative_path: str,
                byte_offset: int, length: int, checksum: int, encoding: str) -> None:
        row = len(self._hash)
        self._fqn.append(key[0])
        self._replica.append(key[1])
        self._ndim.append(key[2])
        self._at.append(len(self._offsets))
        if offset is not None:
            self._offsets.extend(offset)
        self._file.append(self._id(relative_path))
        self._encoding.append(self._id(encoding))
        self._start.append(byte_offset)
        self._length.append(length)
        self._crc.append(checksum)
        self._hash.append(h)
        self._slots[slot] = row
        if 2 * len(self._hash) > len(self._slots):
            self._index_rows(2 * len(self._slots))

    def _id(self, name: str) -> int:
        found = self._ids.get(name)
        if found is None:
            found = self._ids[name] = len(self._names)
            self._names.append(name)
        return found

    # ------------------------------------------------------------------ the hash index

    def _key(self, fqn: str, offset: Optional[Tuple[int, ...]], index: Optional[int],
             adding: bool = False) -> Optional[Tuple[int, ...]]:
        """The row key of an item: ``(fqn id, replica code, ndim code, *offsets)``; None for an
        item that cannot be in the table (unknown fqn) unless ``adding``."""
        if index is not None and index < 0:
            if adding:
                raise ValueError(f"replica index {index} of {fqn!r} is negative")
            return None
        fid = self._id(fqn) if adding else self._ids.get(fqn)
        if fid is None:
            return None
        replica = _NONE if index is None else index
        if offset is None:
            return (fid, replica, _NONE)
        return (fid, replica, len(offset), *offset)

    def _probe(self, key: Tuple[int, ...], h: int) -> Tuple[int, int]:
        """``(row, slot)``: the row holding ``key`` (whose hash is ``h``) and its slot, or
        ``(_EMPTY, free slot)``."""
        slots, hashes = self._slots, self._hash
        mask = len(slots) - 1
        slot = h & mask
        while True:
            row = slots[slot]
            if row == _EMPTY or (hashes[row] == h and self._row_key(row) == key):
                return row, slot
            slot = (slot + 1) & mask

    def _row_key(self, row: int) -> Tuple[int, ...]:
        ndim = self._ndim[row]
        head = (self._fqn[row], self._replica[row], ndim)
        if ndim == _NONE:
            return head
        at = self._at[row]
        return head + tuple(self._offsets[at:at + ndim])

    def _index_rows(self, size: int) -> None:
        """Rebuild the hash index with ``size`` (a power of two) slots."""
        slots, mask = array("i", [_EMPTY]) * size, size - 1
        for row, h in enumerate(self._hash):
            slot = h & mask
            while slots[slot] != _EMPTY:
                slot = (slot + 1) & mask
            slots[slot] = row
        self._slots = slots

    # ------------------------------------------------------------------ reading

    def _row(self, index: object) -> int:
        if not isinstance(index, MetadataIndex):
            return _EMPTY
        key = self._key(index.fqn, index.offset, index.index)
        return _EMPTY if key is None else self._probe(key, hash(key))[0]

    def _index_at(self, row: int) -> MetadataIndex:
        ndim, replica = self._ndim[row], self._replica[row]
        at = self._at[row]
        return MetadataIndex(self._names[self._fqn[row]], None if ndim == _NONE else tuple(self._offsets[at:at + ndim]),
                             None if replica == _NONE else replica)

    def _info_at(self, row: int) -> StorageInfo:
        return StorageInfo(self._names[self._file[row]], self._start[row], self._length[row], self._crc[row],
                           self._names[self._encoding[row]])

    def __getitem__(self, index: MetadataIndex) -> StorageInfo:
        row = self._row(index)
        if row == _EMPTY:
            raise KeyError(index)
        return self._info_at(row)

    def get(self, index: MetadataIndex, default: Optional[StorageInfo] = None) -> Optional[StorageInfo]:
        row = self._row(index)
        return default if row == _EMPTY else self._info_at(row)

    def __contains__(self, index: object) -> bool:
        return self._row(index) != _EMPTY

    def __len__(self) -> int:
        return len(self._hash)

    def __iter__(self) -> Iterator[MetadataIndex]:
        return map(self._index_at, range(len(self._hash)))

    def items(self) -> ItemsView[MetadataIndex, StorageInfo]:
        return _Items(self)

    def values(self) -> ValuesView[StorageInfo]:
        return _Values(self)

    def entries(self) -> Iterator[StorageEntry]:
        """Every row's fields in insertion order, without building the two objects per row
        (for whole-table passes: writing JSON, checking the metadata)."""
        names, offsets = self._names, self._offsets
        for fid, replica, ndim, at, file, start, length, crc, encoding in zip(
                self._fqn, self._replica, self._ndim, self._at, self._file, self._start, self._length,
                self._crc, self._encoding):
            yield StorageEntry(names[fid], None if ndim == _NONE else tuple(offsets[at:at + ndim]),
                               None if replica == _NONE else replica, names[file], start, length, crc,
                               names[encoding])

    def primary_counts(self) -> Counter[str]:
        """fqn -> number of its items with replica ``index`` None (the copies the reader uses)."""
        counts = collections.Counter(fid for fid, replica in zip(self._fqn, self._replica) if replica == _NONE)
        return collections.Counter({self._names[fid]: n for fid, n in counts.items()})

    def __repr__(self) -> str:
        return f"StorageTable({dict(self.items())!r})"

    def __reduce__(self):
        columns = (self._fqn, self._replica, self._ndim, self._at, self._offsets, self._file, self._start,
                   self._length, self._crc, self._encoding, self._hash)
        return _restore, (self._names, columns, hash(_PROBE))


class _Items(ItemsView):
    """``(index, info)`` pairs in insertion order, each built from its row (not looked up)."""

    __slots__ = ()

    def __iter__(self) -> Iterator[Tuple[MetadataIndex, StorageInfo]]:
        table = self._mapping
        return ((table._index_at(row), table._info_at(row)) for row in range(len(table)))


class _Values(ValuesView):
    __slots__ = ()

    def __iter__(self) -> Iterator[StorageInfo]:
        return map(self._mapping._info_at, range(len(self._mapping)))


def _restore(names: List[str], columns: Tuple[array, ...], probe_hash: int) -> StorageTable:
    table = StorageTable()
    table._names, table._ids = names, {name: i for i, name in enumerate(names)}
    (table._fqn, table._replica, table._ndim, table._at, table._offsets, table._file, table._start,
     table._length, table._crc, table._encoding, table._hash) = columns
    if probe_hash != hash(_PROBE):  # another interpreter's int hashing: rehash every key
        table._hash = array("q", (hash(table._row_key(row)) for row in range(len(table._hash))))
    size = 8
    while size < 2 * len(table._hash):
        size *= 2
    table._index_rows(size)
    return table
