"""``DcpReader``: ``load`` straight from a torch DCP checkpoint directory (what torch's
``FileSystemWriter`` and torchtitan write), resharding like any other load.

DCP's metadata is translated into ours (:func:`translate_metadata`: same keys, dtypes, sizes
and chunks, each stored item's file and byte range), so the standard load planner plans the
reads. DCP writes each tensor chunk as a ``torch.save`` record and each value as a
``torch.save``'d object; both are read with ``torch.load(weights_only=True)`` (torch's own
restricted unpickler), values must be plain data (what our checkpoints store as JSON).
DCP has no checksums: a load with ``verify=True`` logs once that there is nothing to verify.
"""

from __future__ import annotations

import io
import logging
import os
import re
from typing import Any, Dict, Optional, Set

import torch
from torch.distributed.checkpoint import metadata as dcp_md

from hyper_parallel.core.distributed_checkpoint._fileio import open_regular, read_exact
from hyper_parallel.core.distributed_checkpoint.dcp_interop.unpickler import DCP_METADATA_FILE, read_dcp_metadata
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.metadata import (
    METADATA_FILE,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageInfo,
    StorageTable,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.format.geometry import narrow
from hyper_parallel.core.distributed_checkpoint.format.validation import check_tiling
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from hyper_parallel.core.distributed_checkpoint.storage import StorageReader

__all__ = ["DCP_ENCODING", "DcpFiles", "DcpReader", "is_dcp_checkpoint", "read_dcp_item", "translate_metadata"]

DCP_ENCODING = "torch_save"
"""Encoding recorded for every item of a translated DCP checkpoint: a ``torch.save`` record."""

_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's zip format; DCP's other serialisations are refused
_PLAIN = (type(None), bool, int, float, str)
_log = logging.getLogger(__name__)
_told_unverified: Set[str] = set()


def is_dcp_checkpoint(directory: Any) -> bool:
    """True when ``directory`` holds a torch DCP ``.metadata`` and no metadata of ours."""
    if directory is None:
        return False
    path = os.fspath(directory)
    return (os.path.isfile(os.path.join(path, DCP_METADATA_FILE))
            and not os.path.exists(os.path.join(path, METADATA_FILE)))


def translate_metadata(directory: str) -> Metadata:
    """The DCP checkpoint's metadata as ours: tensors with their chunks (checked to tile each
    tensor), values, and each stored item's file and byte range (checksum 0: DCP has none).

    Raises:
        CheckpointError: see :func:`read_dcp_metadata`; chunks that do not tile a tensor, or
            an entry stored nowhere (names the key).
    """
    dcp = read_dcp_metadata(directory)
    source = os.path.join(directory, DCP_METADATA_FILE)
    entries: Dict[str, Any] = {}
    for fqn, md in dcp.state_dict_metadata.items():
        if isinstance(md, dcp_md.TensorStorageMetadata):
            ours = TensorStorageMetadata(md.properties.dtype, tuple(md.size),
                                         [ChunkStorageMetadata(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks])
            check_tiling(fqn, ours, source)
            entries[fqn] = ours
        else:
            entries[fqn] = BytesStorageMetadata()
    storage = StorageTable()
    for index, info in dcp.storage_data.items():
        offset = None if index.offset is None else tuple(index.offset)
        if index.fqn in entries:  # (entries of keys DCP's metadata does not list are ignored)
            storage.insert(index.fqn, offset, None, info.relative_path, info.offset, info.length, 0, DCP_ENCODING)
    for fqn, md in entries.items():
        wanted = [c.offsets for c in md.chunks] if isinstance(md, TensorStorageMetadata) else [None]
        for offsets in wanted:
            if MetadataIndex(fqn, offsets) not in storage:
                raise CheckpointError(f"{source}: {fqn!r} (chunk {offsets}) is stored nowhere")
    return Metadata(state_dict_metadata=entries, storage_data=storage, save_id="torch-dcp")


class _FileSlice(io.RawIOBase):
    """Bytes ``offset..offset+length`` of ``fd`` as a seekable read-only file (positional
    reads: the descriptor's own position is never used)."""

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self._fd, self._start, self._length, self._at = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._length}[whence]
        self._at = max(0, base + position)
        return self._at

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = max(0, min(len(view), self._length - self._at))
        done = os.preadv(self._fd, [view[:wanted]], self._start + self._at) if wanted else 0
        self._at += done
        return done


def _plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, _PLAIN) and _plain(v) for k, v in value.items())
    return False


def read_dcp_item(fd: int, path: str, info: StorageInfo, index: MetadataIndex, md: Any) -> Any:
    """One stored DCP item: the tensor chunk at ``index.offset`` (checked against ``md``, our
    tensor metadata) or a plain value, read from its byte range of ``fd`` with
    ``torch.load(weights_only=True)``.

    Raises:
        CheckpointError: a truncated file, not a ``torch.save`` record, a value that is not
            plain data, or a chunk of another dtype/shape (names the key and the file).
    """
    key = index.fqn
    end = os.fstat(fd).st_size
    if info.offset + info.length > end:
        raise CheckpointError(f"{path} is truncated: {key!r} needs bytes {info.offset}..{info.offset + info.length} "
                              f"but the file ends at {end}")
    magic = bytearray(min(len(_ZIP_MAGIC), info.length))
    read_exact(fd, magic, info.offset, path)
    if magic != _ZIP_MAGIC:
        raise CheckpointError(f"{key!r} in {path} (bytes {info.offset}..{info.offset + info.length}) is not a "
                              "torch.save record: only DCP's default serialization (torch_save) can be read")
    try:  # straight from the file: no copy of the record's bytes is held besides the result
        value = torch.load(_FileSlice(fd, info.offset, info.length), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch.load raises many kinds; all mean unreadable
        refused = re.search(r"GLOBAL ([\w.]+)", str(exc))  # weights_only's refusal names the class
        why = f"it holds a {refused.group(1)}" if refused else f"{type(exc).__name__}"
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"value {key!r} in {path} is not plain data ({why}, which "
                                  "torch.load(weights_only=True) refuses): only plain data (numbers, strings, "
                                  "lists, dicts) can be read; leave it out (import-dcp --exclude)") from None
        raise CheckpointError(f"{key!r} chunk {index.offset} in {path} cannot be read with "
                              f"torch.load(weights_only=True): {why}") from None
    if isinstance(md, TensorStorageMetadata):
        sizes = md.chunks.sizes_at(index.offset)
        if not isinstance(value, torch.Tensor) or value.dtype != md.dtype or tuple(value.shape) != sizes:
            raise CheckpointError(f"{key!r} chunk {index.offset} in {path} holds {_describe(value)}, the metadata "
                                  f"says a {md.dtype} tensor of shape {tuple(sizes)}")
        return value
    if isinstance(value, torch.Tensor) or not _plain(value):
        raise CheckpointError(f"value {key!r} in {path} is {_describe(value)}: only plain data (numbers, strings, "
                              "lists, dicts) can be imported; leave it out (import-dcp --exclude)")
    return value


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


class DcpFiles:
    """The stored items of a translated DCP checkpoint, read on demand (each data file
    opened once, on first use; :meth:`close` closes them)."""

    def __init__(self, directory: str, metadata: Metadata) -> None:
        self.directory, self.metadata = directory, metadata
        self._fds: Dict[str, int] = {}

    def read(self, index: MetadataIndex) -> Any:
        """The tensor chunk or value stored for ``index`` (see :func:`read_dcp_item`)."""
        info = self.metadata.storage_data.get(index)
        if info is None:
            raise CheckpointError(f"{self.directory}: no stored item for {index}")
        path = os.path.join(self.directory, info.relative_path)
        if info.relative_path not in self._fds:
            try:
                self._fds[info.relative_path] = open_regular(path)
            except FileNotFoundError:
                raise CheckpointError(f"{path} is missing: the DCP checkpoint is incomplete") from None
        return read_dcp_item(self._fds[info.relative_path], path, info, index,
                             self.metadata.state_dict_metadata[index.fqn])

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class DcpReader(StorageReader):
    """Reads a torch DCP checkpoint directory for ``load`` (chosen automatically for a
    directory with a DCP ``.metadata`` and none of ours). Every rank reads the chunks
    overlapping its shard; a chunk is decoded once however many reads use it."""

    def __init__(self, checkpoint_dir: Optional[str] = None) -> None:
        self.path = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        self.metadata: Optional[Metadata] = None

    def initialize_reader(self, checkpoint_id: Optional[str]) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        if not self.path:
            raise ValueError("no checkpoint path: pass checkpoint_id or DcpReader(path)")

    def load_metadata(self, **kwargs: Any) -> Metadata:
        return translate_metadata(self.path)

    def configure_reader(self, metadata: Metadata, is_coordinator: bool, **kwargs: Any) -> None:
        self.metadata = metadata
        if kwargs.get("verify", True) and is_coordinator and self.path not in _told_unverified:
            _told_unverified.add(self.path)
            _log.warning("%s is a torch DCP checkpoint: it has no checksums, so load(verify=True) verifies "
                         "nothing (pass verify=False to say so)", self.path)

    def execute_read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        items = sorted(plan.items, key=lambda it: (it.storage_index.fqn, it.storage_index.offset or ()))
        files = DcpFiles(self.path, self.metadata)
        cached_index, cached = None, None
        try:
            for item in items:
                if item.type == LoadItemType.BYTE_IO:
                    planner.apply_bytes(item, files.read(item.storage_index))
                    continue
                if item.storage_index != cached_index:  # resharding may cut one chunk into several reads
                    cached_index, cached = None, None
                    cached = files.read(item.storage_index)
                    cached_index = item.storage_index
                dest = planner.acquire_tensor(item)
                with torch.no_grad():
                    dest.copy_(narrow(cached, item.storage_offsets, item.lengths))
                planner.apply_tensor(item, dest)
        finally:
            files.close()
