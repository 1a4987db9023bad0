"""Consistency of checkpoint metadata and of its data files: the checks ``load`` and ``verify``
share (one place).

- :func:`check_metadata`: every tensor's chunks tile it exactly (inside its bounds, no overlap,
  no gap), every chunk and value has exactly one stored location of the right length, and
  every byte range lies inside its file's recorded size without overlapping another.
- :func:`open_data_file`: a data file exists and has its recorded size, checked before any
  buffer is sized from the metadata.
- :func:`verify_files`: every stored item of each data file and the whole file match their
  checksums, in one sequential pass per file, and values pass :func:`decode_stored_value`
  (what ``load`` checks: JSON decodes, pickles only with the opt-in).

The metadata document's field types, ranges and nesting are checked while parsing it
(``Metadata.from_json``).
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Optional, Tuple

from hyper_parallel.core.distributed_checkpoint._fileio import open_regular
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.checksum import crc32, crc32_combine
from hyper_parallel.core.distributed_checkpoint.format.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageEntry,
    TensorStorageMetadata,
    check_relative_path,
)

from hyper_parallel.core.distributed_checkpoint.format.values import decode_value

_BLOCK = 1 << 24  # bytes read at a time by _verify_file


def check_tiling(fqn: str, md: TensorStorageMetadata, source: str) -> None:
    """The chunks of ``md`` cover every element exactly once, or CheckpointError."""
    for chunk in md.chunks:
        if any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, md.size)):
            raise CheckpointError(f"{source}: chunk at {chunk.offsets} of size {chunk.sizes} lies outside "
                                  f"{fqn!r} of size {md.size}")
    covered, total = sum(math.prod(c.sizes) for c in md.chunks), math.prod(md.size)
    boxes = [c for c in md.chunks if math.prod(c.sizes)]
    if boxes:
        # Sweep along the dimension with the most distinct offsets: only chunks whose ranges
        # on it intersect are compared on every dimension.
        dim = max(range(len(md.size)), key=lambda d: len({c.offsets[d] for c in boxes}), default=None)
        if dim is not None:  # (scalars: every chunk is the whole tensor)
            boxes.sort(key=lambda c: c.offsets[dim])
        active: List[ChunkStorageMetadata] = []
        for box in boxes:
            if dim is not None:
                active = [a for a in active if a.offsets[dim] + a.sizes[dim] > box.offsets[dim]]
            for other in active:
                if all(o1 < o2 + s2 and o2 < o1 + s1
                       for o1, s1, o2, s2 in zip(box.offsets, box.sizes, other.offsets, other.sizes)):
                    raise CheckpointError(f"{source}: chunks at {other.offsets} and {box.offsets} of {fqn!r} "
                                          "overlap; refusing a checkpoint whose chunks do not tile the tensor")
            active.append(box)
    if covered != total:  # (disjoint, so fewer: a chunk is missing)
        raise CheckpointError(f"{source}: the chunks of {fqn!r} cover {covered} of its {total} elements, "
                              "a chunk is missing; refusing a checkpoint whose chunks do not tile the tensor")


def _expected_location(metadata: Metadata, entry: StorageEntry, source: str) -> Tuple[int, Tuple[str, ...]]:
    """(byte length, allowed encodings) of a stored item, from the tensor/value it belongs to."""
    md = metadata.state_dict_metadata.get(entry.fqn)
    if md is None:
        raise CheckpointError(f"{source}: stored item {_index(entry)} belongs to no entry of state_dict_metadata")
    if isinstance(md, TensorStorageMetadata):
        sizes = md.chunks.sizes_at(entry.offset)
        if sizes is None:
            raise CheckpointError(f"{source}: stored item {_index(entry)} is not a chunk of {entry.fqn!r}")
        return math.prod(sizes) * md.dtype.itemsize, ("raw",)
    if entry.offset is not None:
        raise CheckpointError(f"{source}: stored value {_index(entry)} has a chunk offset")
    return -1, ("json", "pickle")


def _index(entry: StorageEntry) -> MetadataIndex:
    return MetadataIndex(entry.fqn, entry.offset, entry.index)


def check_metadata(metadata: Metadata, source: str) -> None:
    """Refuse metadata whose parts do not fit together (see the module docstring).

    Raises:
        CheckpointError: names the tensor, item or file that is inconsistent.
    """
    primary = metadata.storage_data.primary_counts()
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            check_tiling(fqn, md, source)
            # Stored items are distinct and (checked below) each one a chunk: as many primary
            # copies as chunks means every chunk is stored. Otherwise name a chunk that is not.
            if primary[fqn] != len(md.chunks):
                for chunk in md.chunks:
                    if MetadataIndex(fqn, chunk.offsets) not in metadata.storage_data:
                        raise CheckpointError(f"{source}: chunk {chunk.offsets} of {fqn!r} is stored nowhere")
        elif MetadataIndex(fqn) not in metadata.storage_data:
            raise CheckpointError(f"{source}: value {fqn!r} is stored nowhere")
    ranges: Dict[str, List[Tuple[int, int, int]]] = {}
    for row, entry in enumerate(metadata.storage_data.entries()):
        length, encodings = _expected_location(metadata, entry, source)
        if entry.encoding not in encodings or (length >= 0 and entry.length != length):
            raise CheckpointError(f"{source}: stored item {_index(entry)} has {entry.length} bytes of encoding "
                                  f"{entry.encoding!r}; its metadata implies {length} bytes of {encodings}")
        file = metadata.files.get(entry.relative_path)
        if file is None:
            raise CheckpointError(f"{source}: stored item {_index(entry)} is in {entry.relative_path!r}, "
                                  "which the metadata does not list")
        if entry.byte_offset + entry.length > file.size:
            raise CheckpointError(f"{source}: stored item {_index(entry)} ends at byte "
                                  f"{entry.byte_offset + entry.length} of {entry.relative_path!r}, which has "
                                  f"{file.size} bytes")
        ranges.setdefault(entry.relative_path, []).append((entry.byte_offset, entry.length, row))
    for name, spans in ranges.items():
        spans.sort()
        for (start, length, row), (next_start, _, next_row) in zip(spans, spans[1:]):
            if start + length > next_start:
                named = {i: _index(e) for i, e in enumerate(metadata.storage_data.entries()) if i in (row, next_row)}
                raise CheckpointError(f"{source}: stored items {named[row]} and {named[next_row]} overlap in {name!r}")


def open_data_file(directory: str, name: str, metadata: Metadata) -> int:
    """Open a data file for reading after checking it exists and has its recorded size.

    Raises:
        CheckpointError: missing, not listed in the metadata, or of another size.
    """
    check_relative_path(name)
    path = os.path.join(directory, name)
    expected = metadata.files.get(name)
    if expected is None:
        raise CheckpointError(f"checkpoint file {path} is not listed in the metadata")
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"cannot open checkpoint file {path}: {exc.strerror or exc}") from None
    actual = os.fstat(fd).st_size
    if actual != expected.size:
        os.close(fd)
        raise CheckpointError(f"checkpoint file {path} has {actual} bytes, metadata says {expected.size} "
                              "(truncated or replaced)")
    return fd


def decode_stored_value(data: bytes, encoding: str, key: str, *, allow_pickle: bool, unpickle: bool = True) -> Any:
    """The value stored as ``data``: the one check of stored values ``load`` and ``verify``
    share. JSON is decoded (nesting bounded); a pickle is refused without ``allow_pickle``,
    else unpickled, or with ``unpickle=False`` (verify) accepted unrun; other encodings are refused.

    Raises:
        CheckpointError: names the key and what is wrong.
    """
    if encoding == "pickle" and allow_pickle and not unpickle:
        return None
    try:
        return decode_value(data, encoding, key, allow_pickle=allow_pickle)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


ReadAt = Callable[[int, int], bytes]
"""``read(offset, n)``: up to ``n`` bytes of a data file from ``offset`` (fewer only at its end)."""


def _crc_range(read: ReadAt, start: int, length: int, path: str, keep: bool) -> Tuple[int, bytes]:
    crc, parts = 0, []
    end = start + length
    while start < end:
        block = read(start, min(_BLOCK, end - start))
        if not block:
            raise CheckpointError(f"{path} is truncated at byte {start}")
        crc = crc32(block, crc)
        if keep:
            parts.append(block)
        start += len(block)
    return crc, b"".join(parts)


def verify_files(directory: str, metadata: Metadata, allow_pickle: bool = False,
                 open_file: Optional[Callable[[str], ContextManager[ReadAt]]] = None) -> None:
    """Check every data file of the checkpoint in name order (:func:`_verify_file`), the stored
    items grouped by file in one pass over the storage table. Pickled values are refused
    unless ``allow_pickle`` (as ``load`` does; they are never unpickled here). ``open_file(name)``
    opens a data file elsewhere (object stores: checked to exist with its recorded size);
    default: the file ``name`` in the local ``directory``.

    Raises:
        CheckpointError: names the file and the item or byte range that does not match.
    """
    by_file: Dict[str, List[StorageEntry]] = {name: [] for name in metadata.files}
    for entry in metadata.storage_data.entries():
        by_file.setdefault(entry.relative_path, []).append(entry)
    for name in sorted(metadata.files):
        opened = open_file(name) if open_file is not None else _local_file(directory, name, metadata)
        with opened as read:
            _verify_file(f"{directory}/{name}" if open_file else os.path.join(directory, name), read, name,
                         metadata, by_file[name], allow_pickle)


@contextlib.contextmanager
def _local_file(directory: str, name: str, metadata: Metadata) -> Iterator[ReadAt]:
    fd = open_data_file(directory, name, metadata)
    try:
        yield lambda offset, n: os.pread(fd, n, offset)
    finally:
        os.close(fd)


def _verify_file(path: str, read: ReadAt, name: str, metadata: Metadata, entries: List[StorageEntry],
                 allow_pickle: bool) -> None:
    """Check the items ``entries`` stored in data file ``name`` (all of them) and the whole
    file against their checksums in one sequential read, and its values as ``load`` would
    (:func:`decode_stored_value`; pickled ones are not unpickled).

    Raises:
        CheckpointError: names the file and the item or byte range that does not match.
    """
    end = StorageEntry("", None, None, name, metadata.files[name].size, 0, 0, "raw")
    file_crc, position = 0, 0
    for entry in sorted(entries, key=lambda e: e.byte_offset) + [end]:
        if entry.byte_offset > position:  # bytes between items (headers, padding)
            gap_crc, _ = _crc_range(read, position, entry.byte_offset - position, path, keep=False)
            file_crc = crc32_combine(file_crc, gap_crc, entry.byte_offset - position)
        if entry is end:
            break
        crc, data = _crc_range(read, entry.byte_offset, entry.length, path, keep=entry.encoding == "json")
        if crc != entry.checksum:
            raise CheckpointError(f"checkpoint file {path} fails its checksum at bytes {entry.byte_offset}.."
                                  f"{entry.byte_offset + entry.length} ({entry.fqn}): the file is corrupt")
        if entry.encoding != "raw":
            decode_stored_value(data, entry.encoding, entry.fqn, allow_pickle=allow_pickle, unpickle=False)
        file_crc = crc32_combine(file_crc, crc, entry.length)
        position = entry.byte_offset + entry.length
    if file_crc != metadata.files[name].checksum:
        raise CheckpointError(f"checkpoint file {path} fails its checksum: the file is corrupt")
