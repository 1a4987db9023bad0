"""The safetensors container: tensor names, header encoding and header parsing.

One definition shared by the checkpoint writer/reader (``filesystem/``)
and the Hugging Face interop (``hf.py``). The dtype tags live in ``format/metadata.py``
(``DTYPE_TO_SAFETENSORS``) because metadata validation needs them too.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Tuple

import torch

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.metadata import DTYPE_TO_SAFETENSORS, MetadataIndex

DTYPE_BY_TAG: Dict[str, torch.dtype] = {tag: dtype for dtype, tag in DTYPE_TO_SAFETENSORS.items()}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit

# (name, dtype, shape, nbytes) of one tensor, in file order.
HeaderEntry = Tuple[str, torch.dtype, Tuple[int, ...], int]


def tensor_name(index: MetadataIndex) -> str:
    """The safetensors key of a stored chunk: ``fqn@offsets`` (``#i`` for extra replicas)."""
    name = index.fqn + "@" + ",".join(str(o) for o in index.offset)
    return name if index.index is None else f"{name}#{index.index}"


def encode_header(entries: List[HeaderEntry]) -> bytes:
    """The 8-byte length plus JSON header of a file holding ``entries`` back to back; the
    data section starts 8-byte aligned."""
    header: Dict[str, Any] = {"__metadata__": {"format": "pt", "writer": "hyper_parallel"}}
    start = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": DTYPE_TO_SAFETENSORS[dtype], "shape": list(shape),
                        "data_offsets": [start, start + nbytes]}
        start += nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    return len(body).to_bytes(8, "little") + body


def read_header(path: str) -> Tuple[Dict[str, Any], int]:
    """``(header, data_start)`` of a safetensors file.

    Raises:
        CheckpointError: the file is too short, its header is longer than the file or than
            ``MAX_HEADER_BYTES`` (checked before reading it), or not a JSON object.
    """
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise CheckpointError(f"{path} is not a safetensors file (too short)")
        length = int.from_bytes(prefix, "little")
        if length > os.fstat(f.fileno()).st_size - 8:
            raise CheckpointError(f"{path} is not a safetensors file (header length {length})")
        if length > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path} has a {length}-byte safetensors header; refusing headers over "
                                  f"{MAX_HEADER_BYTES} bytes")
        try:
            header = json.loads(f.read(length))
        except (ValueError, RecursionError) as exc:
            raise CheckpointError(f"{path} has a corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} has a corrupt safetensors header: not a JSON object")
    return header, 8 + length
