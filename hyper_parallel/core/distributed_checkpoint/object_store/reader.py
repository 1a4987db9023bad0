"""``FsspecReader``: a load's ranged reads from a checkpoint on an fsspec file system.

Each rank fetches byte ranges: a chunk it must check (``planning/verify_plan.py``) whole,
otherwise only the rows of the chunk its box lies in; the ranges of a batch go out together
(``cat_ranges``: concurrent GETs on s3fs), adjacent ranges of one object merged into one GET
of up to ``SPAN_BYTES``. A chunk several ranks need part of is fetched by one of them and
forwarded to the others (``forwarding.py``): every stored byte is fetched once in all.

Fetched bytes land in host memory; a destination that is not plain host memory of the stored
dtype (device memory above all) gets them through the staging pool's pinned slabs on the copy
stream (``host_memory/bounce.py``), the path of local loads.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from typing import Any, Dict, FrozenSet, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.host_memory.bounce import BounceReads, load_bounces
from hyper_parallel.core.distributed_checkpoint.format.checksum import crc32
from hyper_parallel.core.distributed_checkpoint.format.geometry import narrow
from hyper_parallel.core.distributed_checkpoint.format.metadata import (
    Metadata,
    MetadataIndex,
    StorageInfo,
)
from hyper_parallel.core.distributed_checkpoint.format.validation import decode_stored_value
from hyper_parallel.core.distributed_checkpoint.object_store import forwarding, store
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
        forward: with a process group, a chunk several ranks need part of is fetched whole by one
            of them and sent to the others (``forwarding.py``: each stored byte fetched once in
            all); False: each rank fetches what it needs itself.
    """

    stored_as = "object"

    def __init__(self, url: Optional[str] = None, *, verify: bool = True, allow_pickle: bool = False,
                 storage_options: Optional[Dict[str, Any]] = None, forward: bool = True) -> None:
        self.url, self.verify, self.allow_pickle, self.forward = url, verify, allow_pickle, forward
        self.storage_options = storage_options
        self.fs: Any = None
        self.path = ""
        self.metadata: Optional[Metadata] = None
        self._verifying = verify

    def initialize_reader(self, checkpoint_id: Optional[str]) -> None:
        self.url, self.fs, self.path = store.open_checkpoint(checkpoint_id, self.url, self.storage_options,
                                                             type(self).__name__)

    def read_metadata(self) -> Metadata:
        """The checkpoint's committed metadata; works without a process group."""
        return store.read_metadata(self.fs, self.path, self.url)

    def stored_at(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _plan_fetch(self, info: StorageInfo, item: ReadItem, duties, whole: bool = False) -> _Fetch:
        if item.type == LoadItemType.BYTE_IO:
            return _Fetch(info, item, info.offset, info.offset + info.length, None, True)
        md = self.metadata.state_dict_metadata[item.storage_index.fqn]
        sizes = self._chunk_sizes(item, info)
        checked = self._verifying and (reads_whole(item, sizes) or duties is None or item.storage_index in duties)
        if checked or not sizes or whole:
            return _Fetch(info, item, info.offset, info.offset + info.length, sizes, True)
        row = math.prod(sizes[1:]) * md.dtype.itemsize  # only the rows the box lies in
        first, rows = item.storage_offsets[0], item.lengths[0]
        return _Fetch(info, item, info.offset + first * row, info.offset + (first + rows) * row, sizes, False)

    def optimize_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        """Coordinator: the checking duties, then a source for each chunk that several ranks
        need part of (``forwarding.py``), unless ``forward=False``."""
        plans = super().optimize_global_plan(plans)
        if not self.forward or len(plans) < 2:
            return plans
        return forwarding.plan_forwards(plans, lambda index: self._storage(index).length, BATCH_BYTES,
                                        forwarding.PIECE_BYTES)

    def execute_read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Fetch and apply every item of ``plan``; destinations not filled in place (device
        memory, strided views, another dtype) get their bytes through the staging pool's
        pinned slabs on the copy stream (``host_memory/bounce.py``), as local loads do."""
        exchange = plan.storage_data if isinstance(plan.storage_data, forwarding.ForwardingPlan) else None
        if exchange is not None:
            plan = LoadPlan(plan.items, exchange.verification, plan.planner_data)
        # The caller's device and stream: the copy stream is ordered after its queued work.
        (bounce,) = load_bounces(planner)
        device = bounce.device
        try:
            if exchange is None:
                self._fetch(self._prepare(plan, set()), planner, bounce)
            else:
                self._read_and_forward(plan, exchange, planner, bounce, device)
        finally:
            bounce.finish()
        bounce.make_current_wait()  # the caller's later work follows the copies

    def _prepare(self, plan: LoadPlan, received: Set[MetadataIndex],
                 shared: FrozenSet[MetadataIndex] = frozenset()) -> List[_Fetch]:
        """This rank's fetches (whole for ``shared`` chunks), after checking the objects it
        fetches from (one request each); the chunks in ``received`` come from other ranks."""
        duties = duties_of(plan)
        fetches = [self._plan_fetch(self._storage(item.storage_index), item, duties,
                                    whole=item.storage_index in shared) for item in plan.items]
        for name in sorted({f.info.relative_path for f in fetches if f.item.storage_index not in received}):
            store.check_object(self.fs, self.path, self.url, name, self.metadata)
        return fetches

    def _read_and_forward(self, plan: LoadPlan, exchange: forwarding.ForwardingPlan, planner: LoadPlanner,
                          bounce: BounceReads, device: torch.device) -> None:
        """The fetches of a load with forwarded chunks, in the order of ``forwarding.py``: agree
        that every rank is ready, fetch the rest, then the rounds; raises the first failure."""
        rank, forwards = dist.get_rank(), exchange.forwards
        try:
            forwarder, mine, direct = self._plan_exchange(plan, exchange, rank, planner, bounce, device)
        except Exception as exc:  # noqa: BLE001 (every rank hears of it before anyone waits on a peer)
            forwarding.agree(exc, device)  # raises (on every rank)
            raise
        forwarding.agree(None, device)  # raises if another rank failed
        failure: Optional[BaseException] = None
        try:
            self._fetch(direct, planner, bounce)
        except Exception as exc:  # noqa: BLE001 (raised after the exchange: the others must not wait forever)
            failure = exc
        for group in forwarding.rounds(forwards):
            held: Dict[MetadataIndex, memoryview] = {}
            if failure is None:
                try:
                    self._fetch([f for forward in group for f in mine.get(forward.index, [])], planner, bounce, held)
                except Exception as exc:  # noqa: BLE001 (as above)
                    failure = exc
            failure = forwarder.exchange(group, held, failure)
        if failure is not None:
            raise failure

    def _plan_exchange(self, plan: LoadPlan, exchange: forwarding.ForwardingPlan, rank: int, planner: LoadPlanner,
                       bounce: BounceReads, device: torch.device
                       ) -> Tuple[forwarding.Forwarder, Dict[MetadataIndex, List[_Fetch]], List[_Fetch]]:
        """(this rank's side of the exchange, its fetches of the chunks it forwards by chunk, its
        other fetches), the objects it fetches from checked."""
        forwards = exchange.forwards
        sourced = {f.index for f in forwards if f.source == rank}
        received = {f.index for f in forwards} - sourced
        mine: Dict[MetadataIndex, List[_Fetch]] = defaultdict(list)
        theirs: Dict[MetadataIndex, List[ReadItem]] = defaultdict(list)
        direct: List[_Fetch] = []
        for fetch in self._prepare(plan, received, frozenset(f.index for f in forwards)):
            index = fetch.item.storage_index
            if index in sourced:
                mine[index].append(fetch)
            elif index in received:
                theirs[index].append(fetch.item)
            else:
                direct.append(fetch)
        forwarder = forwarding.Forwarder(forwards, rank, self.metadata, planner, bounce, exchange.piece_bytes,
                                         device, theirs)
        return forwarder, mine, direct

    def _fetch(self, fetches: List[_Fetch], planner: LoadPlanner, bounce: BounceReads,
               keep: Optional[Dict[Any, memoryview]] = None) -> None:
        """Fetch and apply ``fetches`` in batches of ``BATCH_BYTES``; whole chunks into ``keep``."""
        fetches = sorted(fetches, key=lambda f: (f.info.relative_path, f.start))
        batch: List[_Fetch] = []
        held = 0
        for fetch in fetches:
            if batch and held + fetch.end - fetch.start > BATCH_BYTES:
                self._run(batch, planner, bounce, keep)
                batch, held = [], 0
            batch.append(fetch)
            held += fetch.end - fetch.start
        if batch:
            self._run(batch, planner, bounce, keep)

    def _run(self, batch: List[_Fetch], planner: LoadPlanner, bounce: BounceReads,
             keep: Optional[Dict[Any, memoryview]]) -> None:
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
                self._apply(fetch, piece, planner, bounce)
                if keep is not None:
                    keep[fetch.item.storage_index] = piece

    def _apply(self, fetch: _Fetch, data: memoryview, planner: LoadPlanner, bounce: BounceReads) -> None:
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
        box = narrow(stored, offsets, item.lengths)
        if dest.is_contiguous() and dest.device.type == "cpu" and dest.dtype == md.dtype:
            with torch.no_grad():  # plain memory: one copy from the fetched bytes
                dest.copy_(box)
            planner.apply_tensor(item, dest)
            return
        # Device memory, strided views, other dtypes: as a local load's, through the slabs on
        # the copy stream (a scalar as one row); applied once the copies have run.
        bounce.copy(box.reshape(1) if box.dim() == 0 else box, dest.reshape(1) if dest.dim() == 0 else dest, key)
        bounce.apply_after_copies(item, dest)


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
