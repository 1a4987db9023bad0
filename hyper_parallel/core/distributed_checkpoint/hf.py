"""Hugging Face interop: export a checkpoint as sharded safetensors + index, load such a directory.

``export_hf`` writes ``model-0000i-of-0000n.safetensors`` files and
``model.safetensors.index.json`` (``{"metadata": {"total_size": N}, "weight_map": {key: file}}``).
``load_hf`` describes an HF directory as checkpoint metadata (one chunk per tensor, located by
the safetensors headers) and runs the regular resharding ``load`` on it, so each rank reads only
the byte ranges of its own slices.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

from hyper_parallel.core.distributed_checkpoint import api
from hyper_parallel.core.distributed_checkpoint._fileio import url_scheme, write_file_atomically
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.filesystem.reader import FileSystemReader
from hyper_parallel.core.distributed_checkpoint.format.metadata import (
    MAX_DIMS,
    ChunkStorageMetadata,
    FileInfo,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
    check_relative_path,
)

from hyper_parallel.core.distributed_checkpoint.format.safetensors_format import DTYPE_BY_TAG, read_header
from hyper_parallel.core.distributed_checkpoint.format.validation import check_metadata
from hyper_parallel.core.distributed_checkpoint.object_store import store
from hyper_parallel.core.distributed_checkpoint.state_dict import copy_into, get_model_state_dict

__all__ = ["export_hf", "load_hf", "INDEX_FILE"]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # Hugging Face's default "5GB"
_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_MODEL_PREFIX = "model."
#: What an export's ``convert`` returns for one tensor: a renamed tensor, several, or None.
Converted = Union[Tuple[str, torch.Tensor], Mapping[str, torch.Tensor], None]


# ----------------------------------------------------------------------------- export


def _exported_names(metadata: Metadata) -> Dict[str, str]:
    """HF key -> checkpoint key: the ``model`` entry without its prefix, else every tensor."""
    tensors = [k for k, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)]
    model = [k for k in tensors if k.startswith(_MODEL_PREFIX)]
    if model:
        return {k[len(_MODEL_PREFIX):]: k for k in model}
    return {k: k for k in tensors}


def _nbytes(md: TensorStorageMetadata) -> int:
    return math.prod(md.size) * md.dtype.itemsize


def _plan_shards(sizes: Mapping[str, int], max_shard_bytes: int) -> List[List[str]]:
    """Consecutive groups of keys of at most ``max_shard_bytes`` (a bigger tensor goes alone)."""
    shards: List[List[str]] = []
    current, used = [], 0
    for key, size in sizes.items():
        if current and used + size > max_shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(key)
        used += size
    if current or not shards:
        shards.append(current)
    return shards


def export_hf(checkpoint_dir: Union[str, os.PathLike], out_dir: Union[str, os.PathLike], *,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              convert: Optional[Callable[[str, torch.Tensor], Converted]] = None,
              ) -> Dict[str, Any]:
    """Write the model of a checkpoint as full tensors in Hugging Face safetensors shards.

    Runs in a plain process (no process group). Exports the ``model`` entry of the checkpoint
    with the ``model.`` prefix removed (or every tensor if there is no ``model`` entry). Only one
    shard's tensors are in memory at a time. Old ``model-*-of-*.safetensors`` files in
    ``out_dir`` that are not part of this export are removed. ``convert(name, tensor)`` may
    rename and transform each tensor (return ``(name, tensor)``), split it (return a mapping of
    names to tensors), or return None to leave it out (e.g. the ``transformers`` Llama layout,
    :mod:`hyper_parallel.models.hf_llama`, and Qwen3-MoE's, :mod:`hyper_parallel.models.hf_moe`). ``checkpoint_dir`` and ``out_dir`` may
    be fsspec URLs (``s3://...``, ``memory://...``): each shard is then written to a local
    temporary file, uploaded and removed before the next one.

    Returns:
        The index written to ``out_dir/model.safetensors.index.json``.

    Raises:
        ValueError: ``max_shard_bytes < 1``.
        CheckpointError: ``checkpoint_dir`` is not a committed checkpoint or holds no tensors.
    """
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    checkpoint_dir, out_dir = os.fspath(checkpoint_dir), os.fspath(out_dir)
    metadata = api.read_checkpoint_metadata(checkpoint_dir)
    names = dict(sorted(_exported_names(metadata).items()))
    if not names:
        raise CheckpointError(f"{checkpoint_dir} holds no tensors to export")
    stored = {name: metadata.state_dict_metadata[key] for name, key in names.items()}
    shards = _plan_shards({name: _nbytes(md) for name, md in stored.items()}, max_shard_bytes)
    remote = store.open_store(out_dir) if url_scheme(out_dir) else None
    local_dir = tempfile.mkdtemp(prefix="hyper_parallel-export-hf-") if remote else out_dir
    try:
        index = _write_shards(checkpoint_dir, local_dir, remote, names, stored, shards, convert)
    finally:
        if remote:
            shutil.rmtree(local_dir, ignore_errors=True)
    return index


def _write_shards(checkpoint_dir: str, local_dir: str, remote: Optional[Tuple[Any, str]], names: Dict[str, str],
                  stored: Dict[str, TensorStorageMetadata], shards: List[List[str]],
                  convert: Optional[Callable[[str, torch.Tensor], Converted]]) -> Dict[str, Any]:
    """Write (and, for a ``remote`` (file system, path), upload) the shards and the index."""
    os.makedirs(local_dir, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: Dict[str, str] = {}
    total_size = 0
    for file, shard in zip(files, shards):
        tensors = {names[name]: torch.empty(stored[name].size, dtype=stored[name].dtype) for name in shard}
        api.load(tensors, checkpoint_id=checkpoint_dir, no_dist=True)
        written = {name: tensors[names[name]] for name in shard}
        if convert is not None:
            converted: Dict[str, torch.Tensor] = {}
            for item in (convert(n, t) for n, t in written.items()):
                converted.update(item if isinstance(item, Mapping) else [item] if item is not None else [])
            written = converted
        save_file(written, os.path.join(local_dir, file), metadata={"format": "pt"})
        os.chmod(os.path.join(local_dir, file), 0o666 & ~umask)  # save_file leaves its temp file's 0600
        if remote:
            remote[0].put_file(os.path.join(local_dir, file), f"{remote[1]}/{file}")
            os.remove(os.path.join(local_dir, file))
        weight_map.update({name: file for name in written})
        total_size += sum(t.numel() * t.element_size() for t in written.values())
        del tensors, written
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    text = json.dumps(index, indent=2).encode()
    if remote:
        remote[0].pipe_file(f"{remote[1]}/{INDEX_FILE}", text)
        present = store.list_names(*remote)
    else:
        write_file_atomically(os.path.join(local_dir, INDEX_FILE), text)
        present = os.listdir(local_dir)
    for stale in set(present) - set(files):
        if _SHARD_FILE.fullmatch(stale):
            if remote:
                remote[0].rm(f"{remote[1]}/{stale}")
            else:
                os.remove(os.path.join(local_dir, stale))
    return index


# ------------------------------------------------------------------------------- load


def _weight_map(hf_dir: str) -> Dict[str, str]:
    index_path = os.path.join(hf_dir, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            try:
                return dict(json.load(f)["weight_map"])
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index_path} is not a safetensors index: {exc}") from None
    single = os.path.join(hf_dir, SINGLE_FILE)
    if os.path.isfile(single):
        header, _ = read_header(single)
        return {key: SINGLE_FILE for key in header if key != "__metadata__"}
    raise CheckpointError(f"{hf_dir} has neither {INDEX_FILE} nor {SINGLE_FILE}")


def hf_metadata(hf_dir: Union[str, os.PathLike]) -> Metadata:
    """Checkpoint metadata describing an HF safetensors directory (one chunk per tensor).

    Raises:
        CheckpointError: no index / model file, a file is missing or has a corrupt header.
    """
    hf_dir = os.fspath(hf_dir)
    metadata = Metadata(state_dict_metadata={})
    by_file: Dict[str, List[str]] = {}
    for key, file in _weight_map(hf_dir).items():
        by_file.setdefault(file, []).append(key)
    for file, keys in by_file.items():
        check_relative_path(file, os.path.join(hf_dir, INDEX_FILE))
        path = os.path.join(hf_dir, file)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} (listed in the index) is missing")
        header, data_start = read_header(path)
        metadata.files[file] = FileInfo(os.path.getsize(path), 0)
        for key in keys:
            entry = header.get(key)
            if entry is None:
                raise CheckpointError(f"{path} does not hold {key!r}, which the index places there")
            dtype, shape, (start, end) = _header_entry(entry, key, path)
            origin = (0,) * len(shape)
            metadata.state_dict_metadata[key] = TensorStorageMetadata(
                dtype, shape, [ChunkStorageMetadata(origin, shape)])
            metadata.storage_data[MetadataIndex(key, origin)] = StorageInfo(file, data_start + start, end - start, 0)
    check_metadata(metadata, hf_dir)  # byte ranges inside their files and of the right length
    return metadata


def _header_entry(entry: Any, key: str, path: str) -> Tuple[torch.dtype, Tuple[int, ...], Tuple[int, int]]:
    """(dtype, shape, data_offsets) of a safetensors header entry, or CheckpointError."""
    def ints(value: Any, n: Optional[int]) -> bool:
        return (isinstance(value, list) and (n is None or len(value) == n) and len(value) <= MAX_DIMS
                and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value))

    if not isinstance(entry, dict) or not ints(entry.get("shape"), None) or not ints(entry.get("data_offsets"), 2):
        raise CheckpointError(f"{key!r} in {path} has a malformed header entry: {str(entry)[:200]}")
    dtype = DTYPE_BY_TAG.get(entry.get("dtype"))
    if dtype is None:
        raise CheckpointError(f"{key!r} in {path} has unsupported dtype {entry.get('dtype')!r}")
    start, end = entry["data_offsets"]
    if end < start:
        raise CheckpointError(f"{key!r} in {path} has data_offsets {entry['data_offsets']} that end before they start")
    return dtype, tuple(entry["shape"]), (start, end)


class HFSafetensorsReader(FileSystemReader):
    """Reads an HF safetensors directory through the checkpoint reader (no checksums: no verify)."""

    def __init__(self, hf_dir: Union[str, os.PathLike], metadata: Optional[Metadata] = None):
        super().__init__(os.fspath(hf_dir), verify=False)
        self._metadata = metadata

    def read_metadata(self) -> Metadata:
        return hf_metadata(self.path) if self._metadata is None else self._metadata


def _like(target: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor laid out like ``target`` (DTensor or plain) with another dtype."""
    if isinstance(target, DTensor):
        local = torch.empty_like(target.to_local(), dtype=dtype)
        return DTensor.from_local(local, target.device_mesh, target.placements,
                                  shape=target.shape, stride=target.stride(), run_check=False)
    return torch.empty_like(target, dtype=dtype)


def load_hf(model_or_state_dict: Union[nn.Module, Dict[str, torch.Tensor]],
            hf_dir: Union[str, os.PathLike], *, metadata: Optional[Metadata] = None) -> None:
    """Fill a model's parameters/buffers (or a state dict's tensors) from an HF safetensors dir.

    Targets may be DTensors or plain tensors; each rank reads only the byte ranges of its own
    slices. Values are converted to the targets' dtypes. Keys in the directory that the target
    does not have are ignored. Collective when a process group is initialised (all ranks call).
    ``metadata`` describes the directory under other names (e.g. per-expert tensors stacked, in
    :mod:`hyper_parallel.models.hf_moe`); default :func:`hf_metadata`.

    Raises:
        KeyError: target keys missing from the directory (all named).
        ValueError: a stored shape differs from the target's (the key is named).
        CheckpointError: the directory is not a readable safetensors export.
    """
    hf_dir = os.fspath(hf_dir)
    targets = (get_model_state_dict(model_or_state_dict) if isinstance(model_or_state_dict, nn.Module)
               else model_or_state_dict)
    metadata = hf_metadata(hf_dir) if metadata is None else metadata
    stored = metadata.state_dict_metadata
    missing = sorted(k for k in targets if k not in stored)
    if missing:
        raise KeyError(f"{hf_dir} does not hold {missing}")
    for key, target in targets.items():
        if tuple(target.shape) != stored[key].size:
            raise ValueError(f"{key}: shape mismatch, {hf_dir} has {stored[key].size}, "
                             f"the target expects {tuple(target.shape)}")
    # Read into the targets directly where dtypes match, else into a same-layout buffer.
    reads = {k: t if t.dtype == stored[k].dtype else _like(t, stored[k].dtype) for k, t in targets.items()}
    api.load(reads, storage_reader=HFSafetensorsReader(hf_dir, metadata), no_dist=not dist.is_initialized())
    for key, buffer in reads.items():
        if buffer is not targets[key]:
            copy_into(targets[key], buffer, key)
