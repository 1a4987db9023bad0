"""What a checkpoint holds and where each byte lives; (de)serialised as ``metadata.json``."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

FORMAT_NAME = "hyper_parallel.checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"

# torch dtype <-> safetensors dtype tag. Only dtypes safetensors can hold are saved.
DTYPE_TO_SAFETENSORS: Dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_DTYPE_BY_NAME = {str(d).removeprefix("torch."): d for d in DTYPE_TO_SAFETENSORS}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or not loadable into the given state."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPE_BY_NAME[name]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint metadata") from None


@dataclass(frozen=True)
class ChunkStorageMetadata:
    """One stored box of a tensor: global ``offsets`` and ``sizes`` per dim."""

    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]


@dataclass
class TensorStorageMetadata:
    """A tensor's global ``dtype`` and ``size`` and the chunks that together cover it."""

    dtype: torch.dtype
    size: Tuple[int, ...]
    chunks: List[ChunkStorageMetadata] = field(default_factory=list)


@dataclass
class BytesStorageMetadata:
    """A non-tensor value (stored as JSON, or pickled only with an explicit opt-in)."""


StorageMetadata = Union[TensorStorageMetadata, BytesStorageMetadata]


@dataclass(frozen=True)
class MetadataIndex:
    """Names one stored item: ``fqn``, plus the chunk's global ``offset`` for tensors.

    ``index`` is None for the copy the reader uses; extra replicas written with
    ``remove_redundancy=False`` get ``index`` 1, 2, ...
    """

    fqn: str
    offset: Optional[Tuple[int, ...]] = None
    index: Optional[int] = None


@dataclass(frozen=True)
class StorageInfo:
    """Where an item lives: file (relative to the checkpoint dir), byte range, crc32.

    ``encoding`` is ``"raw"`` for tensor bytes, ``"json"`` or ``"pickle"`` for values.
    """

    relative_path: str
    offset: int
    length: int
    checksum: int
    encoding: str = "raw"


@dataclass(frozen=True)
class FileInfo:
    """Size in bytes and crc32 of a whole data file."""

    size: int
    checksum: int


@dataclass
class Metadata:
    """Everything needed to find and check every stored value.

    Attributes:
        state_dict_metadata: flattened fqn -> tensor or bytes metadata.
        storage_data: item -> where it lives.
        files: data file name -> size and checksum.
        layouts: fqn -> {"mesh_shape", "mesh_dim_names", "placements"} at save time (DTensors).
        world_size: ranks that saved it; ``rank`` is set for rank-local metadata
            (``use_collectives=False``) and None for a global one.
        save_id: unique id of the save that wrote it.
    """

    state_dict_metadata: Dict[str, StorageMetadata]
    storage_data: Dict[MetadataIndex, StorageInfo] = field(default_factory=dict)
    files: Dict[str, FileInfo] = field(default_factory=dict)
    layouts: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    world_size: int = 1
    rank: Optional[int] = None
    save_id: str = ""
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        entries = {}
        for fqn, md in self.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                entries[fqn] = {
                    "type": "tensor", "dtype": dtype_name(md.dtype), "size": list(md.size),
                    "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
                }
            else:
                entries[fqn] = {"type": "bytes"}
        storage = [
            {
                "fqn": idx.fqn, "offset": None if idx.offset is None else list(idx.offset),
                "index": idx.index, "file": info.relative_path, "byte_offset": info.offset,
                "length": info.length, "checksum": info.checksum, "encoding": info.encoding,
            }
            for idx, info in self.storage_data.items()
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
        try:
            doc = json.loads(text)
        except (UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(f"{source} is not valid checkpoint metadata JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{source} is not {FORMAT_NAME} metadata")
        if doc.get("version", 0) > FORMAT_VERSION:
            raise CheckpointError(
                f"{source} has format version {doc['version']}; this build reads up to {FORMAT_VERSION}"
            )
        try:
            sd_md: Dict[str, StorageMetadata] = {}
            for fqn, entry in doc["state_dict_metadata"].items():
                if entry["type"] == "tensor":
                    sd_md[fqn] = TensorStorageMetadata(
                        dtype=dtype_from_name(entry["dtype"]),
                        size=tuple(int(s) for s in entry["size"]),
                        chunks=[ChunkStorageMetadata(tuple(c["offsets"]), tuple(c["sizes"]))
                                for c in entry["chunks"]],
                    )
                else:
                    sd_md[fqn] = BytesStorageMetadata()
            storage = {}
            for e in doc["storage_data"]:
                check_relative_path(e["file"], source)
                idx = MetadataIndex(e["fqn"], None if e["offset"] is None else tuple(e["offset"]), e["index"])
                storage[idx] = StorageInfo(e["file"], int(e["byte_offset"]), int(e["length"]),
                                           int(e["checksum"]), e["encoding"])
            files = {}
            for name, f in doc["files"].items():
                check_relative_path(name, source)
                files[name] = FileInfo(int(f["size"]), int(f["checksum"]))
            return cls(
                state_dict_metadata=sd_md, storage_data=storage, files=files,
                layouts=doc.get("layouts", {}), world_size=int(doc["world_size"]),
                rank=doc.get("rank"), save_id=doc.get("save_id", ""), version=doc["version"],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{source} is malformed: {type(exc).__name__}: {exc}") from None


def check_relative_path(name: str, source: str = "metadata") -> None:
    """Refuse file names that could point outside the checkpoint directory.

    Raises:
        CheckpointError: ``name`` is absolute, has a directory part, or is ``.``/``..``.
    """
    if (not isinstance(name, str) or not name or name in (".", "..") or os.path.isabs(name)
            or os.path.basename(name) != name or "/" in name or "\\" in name or "\0" in name):
        raise CheckpointError(f"{source} names file {name!r}, which is outside the checkpoint directory")
