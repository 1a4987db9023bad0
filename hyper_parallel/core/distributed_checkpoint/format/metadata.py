"""What a checkpoint holds and where each byte lives; (de)serialised as ``metadata.json``."""

from __future__ import annotations

import gc
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.chunk_table import ChunkStorageMetadata, ChunkTable
from hyper_parallel.core.distributed_checkpoint.format.storage_table import (
    MetadataIndex,
    StorageEntry,
    StorageInfo,
    StorageTable,
)

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "METADATA_FILE", "MAX_METADATA_BYTES", "DTYPE_TO_SAFETENSORS", "MAX_DIMS",
    "MAX_NESTING",
    "BytesStorageMetadata", "ChunkStorageMetadata", "ChunkTable", "FileInfo", "Metadata",
    "MetadataIndex", "StorageEntry", "StorageInfo", "StorageMetadata", "StorageTable", "TensorStorageMetadata", "check_relative_path",
    "dtype_from_name", "dtype_name",
]

FORMAT_NAME = "hyper_parallel.checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
MAX_METADATA_BYTES = 4 << 30
"""A metadata file or object larger than this is refused unread (ours and torch DCP's). 16,384 FSDP
ranks' model-only metadata is 367 MB (benchmarks/RESULTS.md), about 1.1 GB with AdamW state;
parsing takes ~6x its size."""

# torch dtype <-> safetensors dtype tag. Only dtypes safetensors can hold are saved.
DTYPE_TO_SAFETENSORS: Dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_DTYPE_BY_NAME = {str(d).removeprefix("torch."): d for d in DTYPE_TO_SAFETENSORS}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPE_BY_NAME[name]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata") from None


@dataclass
class TensorStorageMetadata:
    """A tensor's global ``dtype`` and ``size`` and the chunks that together cover it
    (a list of :class:`ChunkStorageMetadata` given here is stored as a :class:`ChunkTable`)."""

    dtype: torch.dtype
    size: Tuple[int, ...]
    chunks: ChunkTable = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, ChunkTable):
            self.chunks = ChunkTable(len(self.size), self.chunks)


@dataclass
class BytesStorageMetadata:
    """A non-tensor value (stored as JSON, or pickled only with an explicit opt-in)."""


StorageMetadata = Union[TensorStorageMetadata, BytesStorageMetadata]


@dataclass(frozen=True, slots=True)
class FileInfo:
    """Size in bytes and crc32 of a whole data file."""

    size: int
    checksum: int


@dataclass
class Metadata:
    """Everything needed to find and check every stored value.

    Attributes:
        state_dict_metadata: flattened fqn -> tensor or bytes metadata.
        storage_data: item -> where it lives (a mapping given here is stored as a
            :class:`StorageTable`).
        files: data file name -> size and checksum.
        layouts: fqn -> {"mesh_shape", "mesh_dim_names", "placements"} at save time (DTensors).
        world_size: ranks that saved it; ``rank`` is set for rank-local metadata
            (``use_collectives=False``) and None for a global one.
        save_id: unique id of the save that wrote it.
    """

    state_dict_metadata: Dict[str, StorageMetadata]
    storage_data: StorageTable = field(default_factory=StorageTable)
    files: Dict[str, FileInfo] = field(default_factory=dict)
    layouts: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    world_size: int = 1
    rank: Optional[int] = None
    save_id: str = ""
    version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.storage_data, StorageTable):
            self.storage_data = StorageTable(self.storage_data)

    def to_json(self) -> str:
        entries = {}
        for fqn, md in self.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                entries[fqn] = {
                    "type": "tensor", "dtype": dtype_name(md.dtype), "size": list(md.size),
                    "chunks": [{"offsets": list(md.chunks.offsets_of(i)), "sizes": list(md.chunks.sizes_of(i))}
                               for i in range(len(md.chunks))],
                }
            else:
                entries[fqn] = {"type": "bytes"}
        storage = [
            {
                "fqn": e.fqn, "offset": None if e.offset is None else list(e.offset), "index": e.index,
                "file": e.relative_path, "byte_offset": e.byte_offset, "length": e.length,
                "checksum": e.checksum, "encoding": e.encoding,
            }
            for e in self.storage_data.entries()
        ]
        doc = {
            "format": FORMAT_NAME, "version": self.version, "save_id": self.save_id,
            "world_size": self.world_size, "rank": self.rank,
            "state_dict_metadata": entries, "storage_data": storage,
            "files": {name: {"size": f.size, "checksum": f.checksum} for name, f in self.files.items()},
            "layouts": self.layouts,
        }
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: Union[str, bytes], source: str = "metadata") -> "Metadata":
        """Parse metadata JSON.

        Raises:
            CheckpointError: not JSON, another format, a newer version, or a field is wrong.
        """
        # Parsing creates millions of objects at scale and no reference cycle: the cyclic
        # collector's passes over them would only cost time.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return cls._from_json(text, source)
        finally:
            if collecting:
                gc.enable()

    @classmethod
    def _from_json(cls, text: Union[str, bytes], source: str) -> "Metadata":
        try:
            doc = json.loads(text)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise CheckpointError(f"{source} is not valid checkpoint metadata JSON: "
                                  f"{type(exc).__name__}: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{source} is not {FORMAT_NAME} metadata")
        version = doc.get("version", 0)
        if _is_int(version) and version > FORMAT_VERSION:
            raise CheckpointError(
                f"{source} has format version {version}; this build reads up to {FORMAT_VERSION}"
            )
        _check_document(doc, source)
        # The schema check above makes every access below well-typed and in range. Chunks go
        # into one compact table per tensor, storage locations into one table of columns.
        sd_md: Dict[str, StorageMetadata] = {}
        for fqn, entry in doc["state_dict_metadata"].items():
            if entry["type"] == "tensor":
                table = ChunkTable(len(entry["size"]))
                for c in entry["chunks"]:
                    table.append_box(c["offsets"], c["sizes"])
                sd_md[fqn] = TensorStorageMetadata(dtype_from_name(entry["dtype"]), tuple(entry["size"]), table)
            else:
                sd_md[fqn] = BytesStorageMetadata()
        files = {name: FileInfo(f["size"], f["checksum"]) for name, f in doc["files"].items()}
        storage = StorageTable()
        for e in doc["storage_data"]:
            offset = None if e["offset"] is None else tuple(e["offset"])
            if not storage.insert(e["fqn"], offset, e["index"], e["file"], e["byte_offset"], e["length"],
                                  e["checksum"], e["encoding"]):
                raise CheckpointError(f"{source} lists storage for {MetadataIndex(e['fqn'], offset, e['index'])} twice")
        return cls(
            state_dict_metadata=sd_md, storage_data=storage, files=files, layouts=doc.get("layouts", {}),
            world_size=doc["world_size"], rank=doc.get("rank"), save_id=doc.get("save_id", ""),
            version=version,
        )


# --------------------------------------------------------------- the metadata document's schema

MAX_DIMS = 64  # tensor dimensions
MAX_NESTING = 16  # depth of a layout entry (JSON lists/objects)
_MAX_INT = 2**63 - 1
_ENCODINGS = ("raw", "json", "pickle")


_STORAGE_KEYS = ("fqn", "offset", "index", "file", "byte_offset", "length", "checksum", "encoding")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(value: Any, low: int = 0, high: int = _MAX_INT) -> bool:
    return type(value) is int and low <= value <= high


def _dims_ok(value: Any, ndim: Optional[int] = None) -> bool:
    """What :meth:`_Schema.dims` accepts, as a predicate (no message)."""
    return (type(value) is list and len(value) <= MAX_DIMS and (ndim is None or len(value) == ndim)
            and all(type(v) is int and 0 <= v <= _MAX_INT for v in value))


class _Schema:
    """Checks one parsed metadata document, naming the first field that is wrong."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, problem: str) -> None:
        raise CheckpointError(f"{self.source} is malformed: {where} {problem}")

    def obj(self, value: Any, where: str, keys: Tuple[str, ...] = ()) -> Dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(where, f"must be an object, not {type(value).__name__}")
        for key in keys:
            if key not in value:
                self.fail(where, f"lacks {key!r}")
        return value

    def seq(self, value: Any, where: str) -> List[Any]:
        if not isinstance(value, list):
            self.fail(where, f"must be a list, not {type(value).__name__}")
        return value

    def text(self, value: Any, where: str) -> str:
        if not isinstance(value, str):
            self.fail(where, f"must be a string, not {type(value).__name__}")
        return value

    def count(self, value: Any, where: str, low: int = 0, high: int = _MAX_INT) -> int:
        if not _is_int(value) or not low <= value <= high:
            self.fail(where, f"must be an integer in [{low}, {high}], not {value!r}")
        return value

    def dims(self, value: Any, where: str, ndim: Optional[int] = None) -> None:
        self.seq(value, where)
        if len(value) > MAX_DIMS or (ndim is not None and len(value) != ndim):
            self.fail(where, f"has {len(value)} dimensions, expected {MAX_DIMS if ndim is None else ndim}")
        for i, v in enumerate(value):
            self.count(v, f"{where}[{i}]")

    def plain(self, value: Any, where: str, depth: int = 0) -> None:
        """JSON data nested at most MAX_NESTING deep."""
        if depth > MAX_NESTING:
            self.fail(where, f"nests deeper than {MAX_NESTING} levels")
        if isinstance(value, list):
            for v in value:
                self.plain(v, where, depth + 1)
        elif isinstance(value, dict):
            for v in value.values():
                self.plain(v, where, depth + 1)


def _check_document(doc: Dict[str, Any], source: str) -> None:
    """Types, ranges and nesting of every field, so that building the Metadata cannot fail
    with anything but CheckpointError."""
    s = _Schema(source)
    s.obj(doc, "the document", ("version", "world_size", "state_dict_metadata", "storage_data", "files"))
    s.count(doc["version"], "version", 1, FORMAT_VERSION)
    world = s.count(doc["world_size"], "world_size", 1, 2**31)
    if doc.get("rank") is not None:
        s.count(doc["rank"], "rank", 0, world - 1)
    s.text(doc.get("save_id", ""), "save_id")
    for fqn, entry in s.obj(doc["state_dict_metadata"], "state_dict_metadata").items():
        where = f"state_dict_metadata[{fqn!r}]"
        s.obj(entry, where, ("type",))
        if entry["type"] == "bytes":
            continue
        if entry["type"] != "tensor":
            s.fail(where, f"has unknown type {entry['type']!r}")
        s.obj(entry, where, ("dtype", "size", "chunks"))
        dtype_from_name(s.text(entry["dtype"], f"{where}.dtype"))
        s.dims(entry["size"], f"{where}.size")
        ndim = len(entry["size"])
        for i, chunk in enumerate(s.seq(entry["chunks"], f"{where}.chunks")):
            if type(chunk) is dict and _dims_ok(chunk.get("offsets"), ndim) and _dims_ok(chunk.get("sizes"), ndim):
                continue  # the common case, checked without building messages
            s.obj(chunk, f"{where}.chunks[{i}]", ("offsets", "sizes"))
            s.dims(chunk["offsets"], f"{where}.chunks[{i}].offsets", ndim)
            s.dims(chunk["sizes"], f"{where}.chunks[{i}].sizes", ndim)
    files_ok = set()
    for i, e in enumerate(s.seq(doc["storage_data"], "storage_data")):
        if (type(e) is dict and type(e.get("fqn")) is str
                and "offset" in e and (e["offset"] is None or _dims_ok(e["offset"]))
                and "index" in e and (e["index"] is None or _int_in(e["index"], 1))
                and type(e.get("file")) is str and e["file"] in files_ok
                and _int_in(e.get("byte_offset")) and _int_in(e.get("length"))
                and _int_in(e.get("checksum"), 0, 2**32 - 1) and e.get("encoding") in _ENCODINGS):
            continue  # the common case, checked without building messages
        where = f"storage_data[{i}]"
        s.obj(e, where, _STORAGE_KEYS)
        s.text(e["fqn"], f"{where}.fqn")
        if e["offset"] is not None:
            s.dims(e["offset"], f"{where}.offset")
        if e["index"] is not None:
            s.count(e["index"], f"{where}.index", 1)
        check_relative_path(e["file"], source)
        files_ok.add(e["file"])
        s.count(e["byte_offset"], f"{where}.byte_offset")
        s.count(e["length"], f"{where}.length")
        s.count(e["checksum"], f"{where}.checksum", 0, 2**32 - 1)
        if e["encoding"] not in _ENCODINGS:
            s.fail(f"{where}.encoding", f"must be one of {_ENCODINGS}, not {e['encoding']!r}")
    for name, f in s.obj(doc["files"], "files").items():
        check_relative_path(name, source)
        s.obj(f, f"files[{name!r}]", ("size", "checksum"))
        s.count(f["size"], f"files[{name!r}].size")
        s.count(f["checksum"], f"files[{name!r}].checksum", 0, 2**32 - 1)
    for fqn, layout in s.obj(doc.get("layouts", {}), "layouts").items():
        s.obj(layout, f"layouts[{fqn!r}]")
        s.plain(layout, f"layouts[{fqn!r}]")


def check_relative_path(name: str, source: str = "metadata") -> None:
    """Refuse file names that could point outside the checkpoint directory.

    Raises:
        CheckpointError: ``name`` is absolute, has a directory part, or is ``.``/``..``.
    """
    if (not isinstance(name, str) or not name or name in (".", "..") or os.path.isabs(name)
            or os.path.basename(name) != name or "/" in name or "\\" in name or "\0" in name):
        raise CheckpointError(f"{source} names file {name!r}, which is outside the checkpoint directory")
