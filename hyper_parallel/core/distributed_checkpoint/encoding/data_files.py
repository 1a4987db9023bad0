"""A rank's data files, whatever stores them: which files a rank writes (:func:`rank_data_files`),
tensor chunks streamed as a safetensors file into any binary stream (:func:`stream_safetensors`)
and non-tensor values as one file per encoding (:func:`encode_values`); each returns where every
item landed and the file's size and crc32."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, Callable, Dict, List, NamedTuple, Optional, Tuple

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.checksum import crc32, crc32_combine
from hyper_parallel.core.distributed_checkpoint.format.metadata import FileInfo, StorageInfo
from hyper_parallel.core.distributed_checkpoint.format.safetensors_format import encode_header, tensor_name
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from hyper_parallel.core.distributed_checkpoint.storage import ChunkSource, WriteResult


def chunk_nbytes(item: WriteItem) -> int:
    """Bytes of a TENSOR write item's chunk."""
    td = item.tensor_data
    return math.prod(td.chunk.sizes) * td.dtype.itemsize


def stream_safetensors(f: BinaryIO, items: List[WriteItem], source: ChunkSource, name: str,
                       written: Optional[Callable[[int, int], None]] = None) -> Tuple[List[WriteResult], FileInfo]:
    """Write ``items`` (TENSOR) as a safetensors file named ``name`` into the open binary
    stream ``f`` (a local file or an object store upload), calling ``written(offset, length)``
    after each piece. On failure ``source`` is aborted (stopping the producer) and the error raised."""
    # The header comes from the plan, so the data can stream in after it.
    entries = [(tensor_name(it.index), it.tensor_data.dtype, it.tensor_data.chunk.sizes, chunk_nbytes(it))
               for it in items]
    header = encode_header(entries)
    results, offset = [], len(header)
    file_crc = crc32(header)
    # crc32 and file writes both release the GIL: checksum each piece on a helper
    # thread while this one writes it, so the checksum costs no extra wall time.
    with ThreadPoolExecutor(1, thread_name_prefix="hyper_parallel-crc") as crc_pool:
        try:
            f.write(header)
            for item, (_, _, _, nbytes) in zip(items, entries):
                known = source.known_checksum(item)
                crc, done = 0, 0
                for piece in source.chunks(item):
                    data = piece.numpy()
                    pending = crc_pool.submit(crc32, data, crc) if known is None else None
                    f.write(data)
                    if written is not None:
                        written(offset + done, len(data))
                    done += len(data)
                    if pending is not None:
                        crc = pending.result()
                piece = data = None  # not held while a streaming source reads the next item
                if done != nbytes:
                    raise CheckpointError(f"{item.index.fqn!r}: {done} bytes staged, the plan says {nbytes}")
                crc = known if known is not None else crc
                file_crc = crc32_combine(file_crc, crc, nbytes)
                results.append(WriteResult(item.index, StorageInfo(name, offset, nbytes, crc)))
                offset += nbytes
        except BaseException as exc:
            source.abort(exc)  # stop the producer and the other files' writers
            raise
    return results, FileInfo(offset, file_crc)


def encode_values(items: List[WriteItem], planner: SavePlanner, name: str,
                  encoding: str) -> Tuple[List[WriteResult], bytes, FileInfo]:
    """The bytes of a values file named ``name``: JSON values form one JSON object
    {fqn: value}; pickles are concatenated."""
    json_file = encoding == "json"
    parts: List[bytes] = [b"{"] if json_file else []
    results, offset = [], len(parts[0]) if parts else 0
    for i, item in enumerate(items):
        if json_file:
            prefix = (b"," if i else b"") + json.dumps(item.index.fqn).encode() + b":"
            parts.append(prefix)
            offset += len(prefix)
        data = planner.get_data(item)
        parts.append(data)
        results.append(WriteResult(item.index, StorageInfo(name, offset, len(data), crc32(data), encoding)))
        offset += len(data)
    if json_file:
        parts.append(b"}")
    blob = b"".join(parts)
    return results, blob, FileInfo(len(blob), crc32(blob))


def split_by_bytes(items: List[WriteItem], parts: int) -> List[List[WriteItem]]:
    """At most ``parts`` non-empty groups of TENSOR items with balanced bytes, each in the
    order of ``items`` (the order the save's copy stages produce them in)."""
    buckets: List[List[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for position in sorted(range(len(items)), key=lambda p: chunk_nbytes(items[p]), reverse=True):
        i = loads.index(min(loads))
        buckets[i].append(position)
        loads[i] += chunk_nbytes(items[position])
    return [[items[p] for p in sorted(b)] for b in buckets if b]


class DataFile(NamedTuple):
    """One data file of a rank's save: its name, its items, and for values their encoding
    (None: a safetensors file of TENSOR items)."""

    name: str
    items: List[WriteItem]
    encoding: Optional[str]


def rank_data_files(plan: SavePlan, rank: int, thread_count: int, allow_pickle: bool,
                    tag: str = "") -> List[DataFile]:
    """The data files a rank writes for ``plan``: ``__{rank}_{i}{tag}.safetensors`` (at most
    ``thread_count``, balanced by bytes) and ``__{rank}{tag}.values.{json,pkl}``.

    Raises:
        ValueError: a value needs pickling and ``allow_pickle`` is off (names the key).
    """
    tensors = [it for it in plan.items if it.type == WriteItemType.TENSOR]
    values: Dict[str, List[WriteItem]] = {}
    for it in plan.items:
        if it.type == WriteItemType.BYTE_IO:
            values.setdefault(it.bytes_io_data.encoding, []).append(it)
    if "pickle" in values and not allow_pickle:
        raise ValueError(f"{values['pickle'][0].index.fqn!r} needs pickling; pass allow_pickle=True")
    files = [DataFile(f"__{rank}_{i}{tag}.safetensors", bucket, None)
             for i, bucket in enumerate(split_by_bytes(tensors, thread_count))]
    files += [DataFile(f"__{rank}{tag}.values.{'json' if encoding == 'json' else 'pkl'}", items, encoding)
              for encoding, items in values.items()]
    return files
