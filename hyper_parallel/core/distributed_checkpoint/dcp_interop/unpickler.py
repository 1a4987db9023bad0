"""A torch DCP checkpoint's ``.metadata`` pickle, read without running anything but DCP's own
metadata classes.

``pickle.load`` on a file someone handed you runs whatever callable the file names. This
unpickler resolves only the globals a DCP ``.metadata`` written by torch's ``FileSystemWriter``
references (found with ``pickletools.dis`` on real ones): DCP's metadata dataclasses, the
per-item storage location, ``torch.Size``, torch dtypes and layouts, the memory-format enum,
``pathlib`` paths (``StorageMeta.checkpoint_id``) and ``collections.OrderedDict``; plain
containers need no global. Anything else is refused, naming ``module.name`` and the file,
before it is called. The result is then checked field by field (:func:`read_dcp_metadata`).
"""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
from typing import Any, Callable, Dict, Tuple

import torch
from torch.distributed.checkpoint import metadata as dcp_md

from hyper_parallel._torch_compat import dcp_mem_format_encoding, dcp_storage_info, get_layout
from hyper_parallel.core.distributed_checkpoint._fileio import read_regular_file
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.filesystem.commit import MAX_METADATA_BYTES
from hyper_parallel.core.distributed_checkpoint.format.metadata import check_relative_path

__all__ = ["DCP_METADATA_FILE", "read_dcp_metadata", "unpickle_dcp_metadata"]

DCP_METADATA_FILE = ".metadata"

_ALLOWED: Dict[Tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.metadata", cls.__name__): cls
    for cls in (dcp_md.Metadata, dcp_md.TensorStorageMetadata, dcp_md.BytesStorageMetadata,
                dcp_md.ChunkStorageMetadata, dcp_md.TensorProperties, dcp_md.MetadataIndex,
                dcp_md.StorageMeta, dcp_mem_format_encoding)
}
_ALLOWED.update({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_storage_info,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): get_layout,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,  # a name only: never touches the file system
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
})


def _torch_attribute(name: str) -> Any:
    value = getattr(torch, name, None)
    return value if isinstance(value, (torch.dtype, torch.layout)) else None


class _DcpUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, source: str) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name))
        if found is None and module == "torch":
            found = _torch_attribute(name)  # torch.float32 & co. are pickled by name
        if found is None:
            raise CheckpointError(
                f"{self.source} references {module}.{name}, which is not one of torch DCP's metadata "
                "classes; refusing to unpickle it (a DCP .metadata holds only those and plain containers)"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.source} holds a persistent reference; a DCP .metadata has none")


def unpickle_dcp_metadata(data: bytes, source: str) -> Any:
    """Unpickle ``data`` admitting only DCP's metadata classes (see the module docstring).

    Raises:
        CheckpointError: a refused global, or a truncated / corrupt pickle (names ``source``).
    """
    try:
        return _DcpUnpickler(io.BytesIO(data), source).load()
    except CheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            KeyError, RuntimeError, MemoryError, RecursionError) as exc:
        raise CheckpointError(f"{source} is not a readable torch DCP .metadata pickle "
                              f"({type(exc).__name__}: {exc}); is the file truncated?") from None


# --------------------------------------------------------------- checks of the unpickled result


def _check(ok: bool, source: str, what: Callable[[], str]) -> None:
    if not ok:
        raise CheckpointError(f"{source} is malformed: {what()}")


def _is_dims(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and all(type(v) is int and v >= 0 for v in value)


def _check_tensor(fqn: str, md: Any, source: str) -> None:
    _check(isinstance(md.properties, dcp_md.TensorProperties) and isinstance(md.properties.dtype, torch.dtype),
           source, lambda: f"{fqn!r} has no tensor dtype")
    _check(_is_dims(md.size), source, lambda: f"{fqn!r} has size {md.size!r}")
    _check(isinstance(md.chunks, list), source, lambda: f"{fqn!r} has chunks {md.chunks!r}")
    for chunk in md.chunks:
        _check(isinstance(chunk, dcp_md.ChunkStorageMetadata) and _is_dims(chunk.offsets) and _is_dims(chunk.sizes)
               and len(chunk.offsets) == len(chunk.sizes) == len(md.size),
               source, lambda: f"{fqn!r} has a chunk {chunk!r} that does not fit its size {tuple(md.size)}")


def _check_storage(index: Any, info: Any, source: str) -> None:
    _check(isinstance(index, dcp_md.MetadataIndex) and isinstance(index.fqn, str), source,
           lambda: f"storage_data has key {index!r}")
    _check(isinstance(info, dcp_storage_info) and type(info.offset) is int and type(info.length) is int
           and info.offset >= 0 and info.length >= 0, source, lambda: f"storage of {index.fqn!r} is {info!r}")
    check_relative_path(info.relative_path, source)
    transforms = info.transform_descriptors  # (the class default, None, when not pickled)
    if transforms:
        raise CheckpointError(
            f"{source}: {index.fqn!r} is stored through the transforms {list(transforms)} (e.g. compression) "
            f"in {info.relative_path}; only untransformed DCP checkpoints can be read: save without them"
        )


def read_dcp_metadata(directory: str) -> Any:
    """The ``torch.distributed.checkpoint.metadata.Metadata`` of the DCP checkpoint in
    ``directory``, unpickled with the restricted unpickler and checked: every entry a tensor
    (dtype, size, chunks inside it) or a value, every stored item inside the directory and
    without transforms (compression, which this reader does not undo).

    Raises:
        CheckpointError: no ``.metadata``, a refused class, or a malformed field (names the file).
    """
    source = os.path.join(directory, DCP_METADATA_FILE)
    try:
        data = read_regular_file(source, MAX_METADATA_BYTES, "DCP metadata")
    except FileNotFoundError:
        raise CheckpointError(f"{directory} is not a torch DCP checkpoint: it has no {DCP_METADATA_FILE}") from None
    metadata = unpickle_dcp_metadata(data, source)
    _check(isinstance(metadata, dcp_md.Metadata), source, lambda: f"it holds a {type(metadata).__name__}")
    _check(isinstance(metadata.state_dict_metadata, dict), source, lambda: "state_dict_metadata is not a dict")
    _check(isinstance(metadata.storage_data, dict), source,
           lambda: "storage_data is not a dict (not written by DCP's FileSystemWriter?)")
    for fqn, md in metadata.state_dict_metadata.items():
        _check(isinstance(fqn, str), source, lambda: f"key {fqn!r} is not a string")
        if isinstance(md, dcp_md.TensorStorageMetadata):
            _check_tensor(fqn, md, source)
        else:
            _check(isinstance(md, dcp_md.BytesStorageMetadata), source, lambda: f"{fqn!r} has metadata {md!r}")
    for index, info in metadata.storage_data.items():
        _check_storage(index, info, source)
    return metadata
