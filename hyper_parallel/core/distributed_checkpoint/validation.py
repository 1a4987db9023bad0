"""Consistency of checkpoint metadata and of its data files: the checks ``load`` and ``verify``
share (one place).

- :func:`check_metadata`: every tensor's chunks tile it exactly (inside its bounds, no overlap,
  no gap), every chunk and value has exactly one stored location of the right length, and
  every byte range lies inside its file's recorded size without overlapping another.
- :func:`open_data_file`: a data file exists and has its recorded size, checked before any
  buffer is sized from the metadata.
- :func:`verify_file`: every stored item of a file and the whole file match their checksums,
  in one sequential pass, and JSON values decode.

The metadata document's field types, ranges and nesting are checked while parsing it
(``Metadata.from_json``).
"""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

from hyper_parallel.core.distributed_checkpoint.checksum import crc32, crc32_combine
from hyper_parallel.core.distributed_checkpoint.metadata import (
    CheckpointError,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
    check_relative_path,
)
from hyper_parallel.core.distributed_checkpoint.resharding import numel
from hyper_parallel.core.distributed_checkpoint.values import decode_value

_BLOCK = 1 << 24  # bytes read at a time by verify_file


def _check_tiling(fqn: str, md: TensorStorageMetadata, source: str) -> None:
    """The chunks of ``md`` cover every element exactly once, or CheckpointError."""
    for chunk in md.chunks:
        if any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, md.size)):
            raise CheckpointError(f"{source}: chunk at {chunk.offsets} of size {chunk.sizes} lies outside "
                                  f"{fqn!r} of size {md.size}")
    covered, total = sum(numel(c.sizes) for c in md.chunks), numel(md.size)
    boxes = [c for c in md.chunks if numel(c.sizes)]
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


def _expected_location(metadata: Metadata, index: MetadataIndex, source: str) -> Tuple[int, Tuple[str, ...]]:
    """(byte length, allowed encodings) of a stored item, from the tensor/value it belongs to."""
    md = metadata.state_dict_metadata.get(index.fqn)
    if md is None:
        raise CheckpointError(f"{source}: stored item {index} belongs to no entry of state_dict_metadata")
    if isinstance(md, TensorStorageMetadata):
        sizes = md.chunks.sizes_at(index.offset)
        if sizes is None:
            raise CheckpointError(f"{source}: stored item {index} is not a chunk of {index.fqn!r}")
        return numel(sizes) * md.dtype.itemsize, ("raw",)
    if index.offset is not None:
        raise CheckpointError(f"{source}: stored value {index} has a chunk offset")
    return -1, ("json", "pickle")


def check_metadata(metadata: Metadata, source: str) -> None:
    """Refuse metadata whose parts do not fit together (see the module docstring).

    Raises:
        CheckpointError: names the tensor, item or file that is inconsistent.
    """
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            _check_tiling(fqn, md, source)
            for chunk in md.chunks:
                if MetadataIndex(fqn, chunk.offsets) not in metadata.storage_data:
                    raise CheckpointError(f"{source}: chunk {chunk.offsets} of {fqn!r} is stored nowhere")
        elif MetadataIndex(fqn) not in metadata.storage_data:
            raise CheckpointError(f"{source}: value {fqn!r} is stored nowhere")
    ranges: Dict[str, List[Tuple[int, int, MetadataIndex]]] = {}
    for index, info in metadata.storage_data.items():
        length, encodings = _expected_location(metadata, index, source)
        if info.encoding not in encodings or (length >= 0 and info.length != length):
            raise CheckpointError(f"{source}: stored item {index} has {info.length} bytes of encoding "
                                  f"{info.encoding!r}; its metadata implies {length} bytes of {encodings}")
        file = metadata.files.get(info.relative_path)
        if file is None:
            raise CheckpointError(f"{source}: stored item {index} is in {info.relative_path!r}, "
                                  "which the metadata does not list")
        if info.offset + info.length > file.size:
            raise CheckpointError(f"{source}: stored item {index} ends at byte {info.offset + info.length} "
                                  f"of {info.relative_path!r}, which has {file.size} bytes")
        ranges.setdefault(info.relative_path, []).append((info.offset, info.length, index))
    for name, spans in ranges.items():
        spans.sort(key=lambda span: span[:2])
        for (start, length, index), (next_start, _, next_index) in zip(spans, spans[1:]):
            if start + length > next_start:
                raise CheckpointError(f"{source}: stored items {index} and {next_index} overlap in {name!r}")


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
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    actual = os.fstat(fd).st_size
    if actual != expected.size:
        os.close(fd)
        raise CheckpointError(f"checkpoint file {path} has {actual} bytes, metadata says {expected.size} "
                              "(truncated or replaced)")
    return fd


def _crc_range(fd: int, start: int, length: int, path: str, keep: bool) -> Tuple[int, bytes]:
    crc, parts = 0, []
    end = start + length
    while start < end:
        block = os.pread(fd, min(_BLOCK, end - start), start)
        if not block:
            raise CheckpointError(f"{path} is truncated at byte {start}")
        crc = crc32(block, crc)
        if keep:
            parts.append(block)
        start += len(block)
    return crc, b"".join(parts)


def verify_file(directory: str, name: str, metadata: Metadata) -> None:
    """Check every item stored in data file ``name`` and the whole file against their
    checksums in one sequential read, and decode its JSON values (pickled ones are not
    unpickled).

    Raises:
        CheckpointError: names the file and the item or byte range that does not match.
    """
    path = os.path.join(directory, name)
    items = sorted(((info, index) for index, info in metadata.storage_data.items()
                    if info.relative_path == name), key=lambda pair: pair[0].offset)
    fd = open_data_file(directory, name, metadata)
    try:
        file_crc, position = 0, 0
        for info, index in items + [(StorageInfo(name, metadata.files[name].size, 0, 0), None)]:
            if info.offset > position:  # bytes between items (headers, padding)
                gap_crc, _ = _crc_range(fd, position, info.offset - position, path, keep=False)
                file_crc = crc32_combine(file_crc, gap_crc, info.offset - position)
            if index is None:
                break
            crc, data = _crc_range(fd, info.offset, info.length, path, keep=info.encoding == "json")
            if crc != info.checksum:
                raise CheckpointError(f"checkpoint file {path} fails its checksum at bytes "
                                      f"{info.offset}..{info.offset + info.length} ({index.fqn}): the file is corrupt")
            if info.encoding == "json":
                try:
                    decode_value(data, "json", index.fqn, allow_pickle=False)
                except ValueError as exc:
                    raise CheckpointError(str(exc)) from None
            file_crc = crc32_combine(file_crc, crc, info.length)
            position = info.offset + info.length
    finally:
        os.close(fd)
    if file_crc != metadata.files[name].checksum:
        raise CheckpointError(f"checkpoint file {path} fails its checksum: the file is corrupt")
