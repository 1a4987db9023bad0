"""``FsspecReader``: a load's ranged reads from a checkpoint on an fsspec file system.

Each rank fetches byte ranges: a chunk it must check (``planning/verify_plan.py``) whole,
otherwise only the rows of the chunk its box lies in; the ranges of a batch go out together
(``cat_ranges``: concurrent GETs on s3fs), adjacent ranges of one object merged into one GET
of up to ``SPAN_BYTES``. Every range is read once per rank.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.checksum import crc32
from hyper_parallel.core.distributed_checkpoint.format.geometry import narrow
from hyper_parallel.core.distributed_checkpoint.format.metadata import Metadata, StorageInfo, TensorStorageMetadata
from hyper_parallel.core.distributed_checkpoint.format.validation import decode_stored_value
from hyper_parallel.core.distributed_checkpoint.object_store import store
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from hyper_parallel.core.distributed_checkpoint.planning.verify_plan import VerifyingReader, duties_of, reads_whole

BATCH_BYTES = 256 << 20
"""Bytes fetched (and held) at once per rank: the ranges of a batch are requested together."""
SPAN_BYTES = 32 << 20
"""Adjacent ranges of one object are fetched as one GET of up to this many bytes (fewer requests;
the spans of a batch still go out concurrently)."""


class _Fetch:
    """One ranged read: the bytes ``start..end`` of a data object and what to do with them."""

    __slots__ = ("info", "item", "start", "end", "sizes", "whole")

    def __init__(self, info: StorageInfo, item: ReadItem, start: int, end: int,
                 sizes: Optional[Tuple[int, ...]], whole: bool) -> None:
        self.info, self.item, self.start, self.end = info, item, start, end
        self.sizes, self.whole = sizes, whole


class FsspecReader(VerifyingReader):
    """Reads a checkpoint under an fsspec URL with ranged reads.

    Args:
        url: the checkpoint's prefix (or pass ``checkpoint_id`` to ``load``).
        verify: check every stored chunk a rank uses against its crc32 (as ``FileSystemReader``).
        allow_pickle: accept pickled values (only for checkpoints you trust).
        storage_options: fsspec options of the file system (on top of its own configuration).
    """

    def __init__(self, url: Optional[str] = None, *, verify: bool = True, allow_pickle: bool = False,
                 storage_options: Optional[Dict[str, Any]] = None) -> None:
        self.url, self.verify, self.allow_pickle = url, verify, allow_pickle
        self.storage_options = storage_options
        self.fs: Any = None
        self.path = ""
        self.metadata: Optional[Metadata] = None
        self._verifying = verify

    def initialize_reader(self, checkpoint_id: Optional[str]) -> None:
        if checkpoint_id is not None:
            self.url = checkpoint_id
        if not self.url:
            raise ValueError("no checkpoint URL: pass checkpoint_id or FsspecReader(url)")
        self.fs, self.path = store.open_store(self.url, self.storage_options)

    def read_metadata(self) -> Metadata:
        """The checkpoint's committed metadata; works without a process group."""
        return store.read_metadata(self.fs, self.path, self.url)

    def load_metadata(self, **kwargs: Any) -> Metadata:
        return self.read_metadata()

    def _check(self, crc: int, info: StorageInfo, what: str) -> None:
        if crc != info.checksum:
            raise CheckpointError(f"checksum mismatch in {self.url}/{info.relative_path} bytes {info.offset}.."
                                  f"{info.offset + info.length} ({what}): the object is corrupt")

    def _plan_fetch(self, info: StorageInfo, item: ReadItem, duties) -> _Fetch:
        if item.type == LoadItemType.BYTE_IO:
            return _Fetch(info, item, info.offset, info.offset + info.length, None, True)
        key = item.storage_index.fqn
        md = self.metadata.state_dict_metadata[key]
        sizes = md.chunks.sizes_at(item.storage_index.offset) if isinstance(md, TensorStorageMetadata) else None
        if sizes is None or math.prod(sizes) * md.dtype.itemsize != info.length:
            raise CheckpointError(f"checkpoint metadata of {key!r} chunk {item.storage_index.offset} is inconsistent")
        checked = self._verifying and (reads_whole(item, sizes) or duties is None or item.storage_index in duties)
        if checked or not sizes:
            return _Fetch(info, item, info.offset, info.offset + info.length, sizes, True)
        row = math.prod(sizes[1:]) * md.dtype.itemsize  # only the rows the box lies in
        first, rows = item.storage_offsets[0], item.lengths[0]
        return _Fetch(info, item, info.offset + first * row, info.offset + (first + rows) * row, sizes, False)

    def execute_read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        duties = duties_of(plan)
        fetches = [self._plan_fetch(self._storage(item.storage_index), item, duties) for item in plan.items]
        for name in sorted({f.info.relative_path for f in fetches}):  # one metadata request each
            store.check_object(self.fs, self.path, self.url, name, self.metadata)
        fetches.sort(key=lambda f: (f.info.relative_path, f.start))
        batch: List[_Fetch] = []
        held = 0
        for fetch in fetches:
            if batch and held + fetch.end - fetch.start > BATCH_BYTES:
                self._run(batch, planner, duties)
                batch, held = [], 0
            batch.append(fetch)
            held += fetch.end - fetch.start
        if batch:
            self._run(batch, planner, duties)

    def _run(self, batch: List[_Fetch], planner: LoadPlanner, duties) -> None:
        spans = _spans(batch)  # batch is sorted by object and offset
        blobs = self.fs.cat_ranges([f"{self.path}/{span[0].info.relative_path}" for span in spans],
                                   [span[0].start for span in spans], [span[-1].end for span in spans],
                                   on_error="return")
        for span, data in zip(spans, blobs):
            first = span[0]
            if isinstance(data, BaseException):
                raise CheckpointError(f"cannot read {self.url}/{first.info.relative_path} bytes "
                                      f"{first.start}..{span[-1].end}: {data}")
            view = memoryview(data)
            for fetch in span:
                piece = view[fetch.start - first.start:fetch.end - first.start]
                if len(piece) != fetch.end - fetch.start:
                    raise CheckpointError(f"{self.url}/{fetch.info.relative_path} is truncated: needed bytes "
                                          f"{fetch.start}..{fetch.end}, got {len(piece)}")
                self._apply(fetch, piece, planner)

    def _apply(self, fetch: _Fetch, data: memoryview, planner: LoadPlanner) -> None:
        item, info = fetch.item, fetch.info
        key = item.storage_index.fqn
        if item.type == LoadItemType.BYTE_IO:
            if self._verifying:
                self._check(crc32(data), info, key)
            planner.apply_bytes(item, decode_stored_value(bytes(data), info.encoding, key, allow_pickle=self.allow_pickle))
            return
        if self._verifying and fetch.whole:
            self._check(crc32(data), info, f"{key} chunk {item.storage_index.offset}")
        md = self.metadata.state_dict_metadata[key]
        with warnings.catch_warnings():  # read only: the buffer is never written through
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
        offsets = list(item.storage_offsets)
        if fetch.whole:
            stored = raw.view(md.dtype).reshape(fetch.sizes)
        else:
            stored = raw.view(md.dtype).reshape((item.lengths[0], *fetch.sizes[1:]))
            offsets[0] = 0
        dest = planner.acquire_tensor(item)
        with torch.no_grad():
            dest.copy_(narrow(stored, offsets, item.lengths))
        planner.apply_tensor(item, dest)


def _spans(batch: List[_Fetch]) -> List[List[_Fetch]]:
    """``batch`` (sorted by object and start) in runs of adjacent fetches of one object, each
    run at most ``SPAN_BYTES`` long unless a single fetch is longer."""
    spans: List[List[_Fetch]] = []
    for fetch in batch:
        last = spans[-1] if spans else None
        if (last is not None and last[-1].info.relative_path == fetch.info.relative_path
                and last[-1].end == fetch.start and fetch.end - last[0].start <= SPAN_BYTES):
            last.append(fetch)
        else:
            spans.append([fetch])
    return spans
