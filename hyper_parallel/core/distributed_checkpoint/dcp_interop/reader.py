"""``DcpReader``: ``load`` straight from a torch DCP checkpoint directory (what torch's
``FileSystemWriter`` and torchtitan write), resharding like any other load.

DCP's metadata is translated into ours (:func:`translate_metadata`: same keys, dtypes, sizes
and chunks, each stored item's file and byte range), so the standard load planner plans the
reads. DCP writes each tensor chunk as a ``torch.save`` record and each value as a
``torch.save``'d object; both are read by ``records.py`` (checked against the metadata before
anything is allocated), values must be plain data (what our checkpoints store as JSON).
DCP has no checksums: a load with ``verify=True`` logs once that there is nothing to verify.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, Optional, Set, Tuple

import torch
from torch.distributed.checkpoint import metadata as dcp_md

from hyper_parallel.core.distributed_checkpoint._fileio import open_regular, url_scheme
from hyper_parallel.core.distributed_checkpoint.dcp_interop.records import ReadAt, read_record
from hyper_parallel.core.distributed_checkpoint.dcp_interop.unpickler import DCP_METADATA_FILE, read_dcp_metadata
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.metadata import (
    METADATA_FILE,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageTable,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.format.geometry import narrow
from hyper_parallel.core.distributed_checkpoint.format.validation import check_tiling
from hyper_parallel.core.distributed_checkpoint.object_store import store
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from hyper_parallel.core.distributed_checkpoint.storage import StorageReader

__all__ = ["DCP_ENCODING", "DcpFiles", "DcpReader", "is_dcp_checkpoint", "translate_metadata"]

DCP_ENCODING = "torch_save"
"""Encoding recorded for every item of a translated DCP checkpoint: a ``torch.save`` record."""

_log = logging.getLogger(__name__)
_told_unverified: Set[str] = set()


def is_dcp_checkpoint(directory: Any) -> bool:
    """True when the local ``directory`` holds a torch DCP ``.metadata`` and no metadata of
    ours (False for URLs: ``load`` reads DCP checkpoints from file systems only)."""
    if directory is None or url_scheme(directory):
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
    source = f"{directory.rstrip('/')}/{DCP_METADATA_FILE}"
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


class DcpFiles:
    """The stored items of a translated DCP checkpoint (a directory or an fsspec URL), read on
    demand (:func:`~.records.read_record`; each data file opened once, on first use;
    :meth:`close` closes them)."""

    def __init__(self, directory: str, metadata: Metadata) -> None:
        self.directory, self.metadata = directory, metadata
        self._store = store.open_store(directory) if url_scheme(directory) else None
        self._files: Dict[str, Tuple[ReadAt, int, Callable[[], None]]] = {}

    def _open(self, name: str, path: str) -> Tuple[ReadAt, int, Callable[[], None]]:
        if self._store is None:
            try:
                fd = open_regular(path)
            except FileNotFoundError:
                raise CheckpointError(f"{path} is missing: the DCP checkpoint is incomplete") from None
            return (lambda offset, view: os.preadv(fd, [view], offset)), os.fstat(fd).st_size, lambda: os.close(fd)
        fs, root = self._store
        try:
            f = fs.open(f"{root}/{name}", "rb")
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing: the DCP checkpoint is incomplete") from None

        def read_at(offset: int, view: memoryview) -> int:
            f.seek(offset)
            return f.readinto(view)

        return read_at, f.size, f.close

    def read(self, index: MetadataIndex) -> Any:
        """The tensor chunk or value stored for ``index``."""
        info = self.metadata.storage_data.get(index)
        if info is None:
            raise CheckpointError(f"{self.directory}: no stored item for {index}")
        path = f"{self.directory.rstrip('/')}/{info.relative_path}"
        if info.relative_path not in self._files:
            self._files[info.relative_path] = self._open(info.relative_path, path)
        read_at, size, _ = self._files[info.relative_path]
        return read_record(read_at, size, path, info, index, self.metadata.state_dict_metadata[index.fqn])

    def close(self) -> None:
        for _, _, close in self._files.values():
            close()
        self._files.clear()


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
