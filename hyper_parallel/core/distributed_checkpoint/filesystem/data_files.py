"""A rank's data files as local files: the backend-neutral encoders of ``encoding/data_files.py``
written through fresh files (``O_EXCL``), fsynced, with their writeback started piece by piece."""

from __future__ import annotations

import os
from typing import List, Tuple

from hyper_parallel.core.distributed_checkpoint._fileio import create_file, write_file
from hyper_parallel.core.distributed_checkpoint.encoding.data_files import encode_values, stream_safetensors
from hyper_parallel.core.distributed_checkpoint.format.metadata import FileInfo
from hyper_parallel.core.distributed_checkpoint.planner import SavePlanner, WriteItem
from hyper_parallel.core.distributed_checkpoint.storage import ChunkSource, WriteResult
from hyper_parallel.utils.fileio import start_writeback


def write_safetensors(path: str, items: List[WriteItem], source: ChunkSource, name: str,
                      sync: bool) -> Tuple[List[WriteResult], FileInfo]:
    """Write ``items`` (TENSOR) as one safetensors file named ``name`` at ``path``, taking
    their bytes piece by piece from ``source`` (each checksummed once, as it is written)."""
    with create_file(path) as f:
        def written(offset: int, length: int) -> None:
            if sync:
                # Disk writes overlap the staging of the next pieces instead of all
                # waiting for the final fsync.
                f.flush()
                start_writeback(f.fileno(), offset, length)

        out = stream_safetensors(f, items, source, name, written)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    return out


def write_values(path: str, items: List[WriteItem], planner: SavePlanner, name: str, encoding: str,
                 sync: bool) -> Tuple[List[WriteResult], FileInfo]:
    """Write serialised values (BYTE_IO) as the file :func:`encode_values` forms."""
    results, blob, info = encode_values(items, planner, name, encoding)
    write_file(path, blob, sync)
    return results, info
