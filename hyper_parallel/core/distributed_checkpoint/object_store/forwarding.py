"""Chunks fetched once from the store and forwarded between ranks during a resharding load.

When several ranks need parts of one stored chunk (``Shard(0)`` -> ``Shard(1)`` gives every
rank a column block of every chunk, and a column block spans all the chunk's rows), fetching
their parts from an object store costs each of them the whole chunk. Instead the coordinator
names one *source* per such chunk (the rank that checks its crc32, else a verifying rank needing
most of it) which fetches it whole, checks it, and sends it to the others over the process
group: every stored byte is fetched once in all (GETs are what object stores charge and
throttle).

The exchange, on every rank of the load (the coordinator puts a :class:`ForwardingPlan` in every
rank's plan only when some chunk is forwarded):

1. *Agreement* (:func:`agree`): each rank plans its fetches, checks the objects it fetches and
   allocates its piece buffer; then one all-reduce of the lowest failed rank (and, only after a
   failure, a broadcast of that rank's message). A rank that failed there raises its error, the
   others raise one naming it: no rank enters a receive its peer will never match.
2. *Rounds* of at most ``round_bytes`` of chunks per source (what a source holds on the host at
   once), in the same global order on every rank: the sources fetch their chunks of the round,
   then walk the round's forwards in order. A chunk goes in *pieces* (:func:`pieces`: boxes of
   whole trailing dims, each a contiguous byte range of at most ``piece_bytes``), so neither
   side holds more than one piece of it in device memory. For each piece, the source sends to
   each target in turn a fixed-size *status* (``STATUS_BYTES``: OK, or FAILED with the first
   error's message), then on OK the piece's bytes; a FAILED status ends that chunk for both
   sides. A source stages each piece from the fetched bytes through the load's pinned slabs and
   copy stream (``host_memory/bounce.py``) into its piece buffer; a target receives into its own
   and copies the boxes it needs straight into their destinations.

Every rank walks every send and receive of the exchange whatever happens (a rank that failed
sends FAILED statuses and skips what it receives), so blocking sends and receives in one global
order cannot deadlock, and each rank raises the first error it met: its own, or the message of
the source that could not forward a chunk.
"""

from __future__ import annotations

import math
import warnings
from collections import defaultdict
from itertools import product
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.host_memory.bounce import BounceReads
from hyper_parallel.core.distributed_checkpoint.format.chunk_table import ChunkStorageMetadata
from hyper_parallel.core.distributed_checkpoint.format.geometry import narrow, overlap
from hyper_parallel.core.distributed_checkpoint.format.metadata import Metadata, MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from hyper_parallel.core.distributed_checkpoint.planning.verify_plan import Verification

PIECE_BYTES = 32 << 20
"""Most bytes of a forwarded chunk sent at once (and held in device memory by each side)."""
STATUS_BYTES = 1024
"""Size of the status sent before each piece: a little-endian uint32 message length (0: OK),
then the failure's message (cut to fit)."""


class Forward(NamedTuple):
    """Chunk ``index`` (``nbytes`` long) goes from ``source`` to ``targets`` in round ``round``."""

    index: MetadataIndex
    source: int
    targets: Tuple[int, ...]
    nbytes: int
    round: int


class ForwardingPlan(NamedTuple):
    """A rank's ``LoadPlan.storage_data`` from an :class:`FsspecReader`'s global plan."""

    verification: Verification
    forwards: Tuple[Forward, ...]
    """The forwards this rank sends or receives, in the global order."""
    piece_bytes: int
    """The coordinator's piece bound (every rank cuts chunks alike)."""


class Piece(NamedTuple):
    """A box of a stored chunk (``offsets``/``lengths``) that is the byte range ``start..end``."""

    offsets: Tuple[int, ...]
    lengths: Tuple[int, ...]
    start: int
    end: int


def plan_forwards(plans: List[LoadPlan], chunk_bytes: Callable[[MetadataIndex], int],
                  round_bytes: int, piece_bytes: int = PIECE_BYTES) -> List[LoadPlan]:
    """Coordinator: name a source for each chunk that two or more ranks need part of.

    ``plans`` carry :class:`Verification` data (duties assigned); the source is the rank
    checking the chunk, else the one needing most of its bytes (verifying ranks first, then
    the lowest). Returns ``plans`` unchanged when nothing is forwarded (no exchange at all).
    """
    needed: Dict[MetadataIndex, Dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for rank, plan in enumerate(plans):
        for item in plan.items:
            if item.type == LoadItemType.TENSOR:
                needed[item.storage_index][rank] += math.prod(item.lengths)
    checker = {index: rank for rank, plan in enumerate(plans) if isinstance(plan.storage_data, Verification)
               for index in plan.storage_data.duties}
    verifying = [isinstance(plan.storage_data, Verification) and plan.storage_data.verifying for plan in plans]
    per_rank: List[List[Forward]] = [[] for _ in plans]
    round_no, in_round = 0, 0
    for index in sorted((i for i, ranks in needed.items() if len(ranks) > 1), key=lambda i: (i.fqn, i.offset)):
        ranks = needed[index]
        source = checker.get(index, min(ranks, key=lambda r: (not verifying[r], -ranks[r], r)))
        nbytes = chunk_bytes(index)
        if not nbytes:
            continue
        if in_round and in_round + nbytes > round_bytes:
            round_no, in_round = round_no + 1, 0
        in_round += nbytes
        forward = Forward(index, source, tuple(sorted(r for r in ranks if r != source)), nbytes, round_no)
        for rank in (source, *forward.targets):
            per_rank[rank].append(forward)
    if not any(per_rank):
        return plans
    return [LoadPlan(plan.items, ForwardingPlan(plan.storage_data, tuple(per_rank[rank]), piece_bytes),
                     plan.planner_data) for rank, plan in enumerate(plans)]


def rounds(forwards: Sequence[Forward]) -> Iterator[List[Forward]]:
    """``forwards`` grouped by round, in order."""
    group: List[Forward] = []
    for forward in forwards:
        if group and forward.round != group[0].round:
            yield group
            group = []
        group.append(forward)
    if group:
        yield group


def pieces(sizes: Sequence[int], itemsize: int, bound: int) -> List[Piece]:
    """The pieces a row-major chunk of ``sizes`` is sent in, in byte order: boxes spanning
    every dim after a split dim, each at most ``bound`` bytes (at least one element)."""
    sizes = tuple(sizes)
    if not sizes:
        return [Piece((), (), 0, itemsize)]
    split = 0  # the first dim whose trailing block (one index along it) fits the bound
    while split < len(sizes) - 1 and math.prod(sizes[split + 1:]) * itemsize > bound:
        split += 1
    block = math.prod(sizes[split + 1:]) * itemsize
    step = max(1, bound // block)
    strides = [math.prod(sizes[d + 1:]) * itemsize for d in range(len(sizes))]
    out = []
    for prefix in product(*(range(n) for n in sizes[:split])):
        for first in range(0, sizes[split], step):
            n = min(step, sizes[split] - first)
            offsets = (*prefix, first) + (0,) * (len(sizes) - split - 1)
            start = sum(o * s for o, s in zip(offsets, strides))
            out.append(Piece(offsets, (1,) * split + (n,) + sizes[split + 1:], start, start + n * block))
    return out


def _encode(failure: Optional[BaseException]) -> torch.Tensor:
    """The status of ``failure`` (None: OK) as ``STATUS_BYTES`` host bytes."""
    status = torch.zeros(STATUS_BYTES, dtype=torch.uint8)
    if failure is not None:
        message = f"{type(failure).__name__}: {failure}".encode(errors="replace")[:STATUS_BYTES - 4]
        status[:4] = torch.tensor(list(len(message).to_bytes(4, "little")), dtype=torch.uint8)
        status[4:4 + len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
    return status


def _decode(status: torch.Tensor) -> Optional[str]:
    """The failure message of a received status, or None for OK."""
    raw = status.cpu().numpy().tobytes()
    length = int.from_bytes(raw[:4], "little")
    return raw[4:4 + length].decode(errors="replace") if length else None


def agree(failure: Optional[BaseException], device: torch.device) -> None:
    """Every rank of the load, before the exchange: raise on every rank when any rank met a
    failure preparing it (``failure``: this rank's, or None). The failed rank raises its own
    error, the others a :class:`CheckpointError` with the lowest failed rank's message."""
    rank, world = dist.get_rank(), dist.get_world_size()
    first = torch.full((1,), rank if failure is not None else world, dtype=torch.int64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    failed = int(first.item())
    if failed == world:
        return
    status = _encode(failure).to(device)
    dist.broadcast(status, src=failed)
    if failure is not None:
        raise failure
    raise CheckpointError(f"the load failed on rank {failed} before the forwarding exchange: {_decode(status)}")


class Forwarder:
    """One rank's side of a load's exchange: the forwards it sends or receives.

    Built before :func:`agree` (it allocates the piece buffer on ``device``, which may fail).
    ``received`` holds this rank's reads of the chunks it is sent; ``bounce`` stages what it
    sends (and must outlive the exchange).
    """

    def __init__(self, forwards: Sequence[Forward], rank: int, metadata: Metadata, planner: LoadPlanner,
                 bounce: BounceReads, piece_bytes: int, device: torch.device,
                 received: Dict[MetadataIndex, List[ReadItem]]) -> None:
        self._rank, self._planner, self._bounce, self._received = rank, planner, bounce, received
        self._layout: Dict[MetadataIndex, Tuple[torch.dtype, List[Piece]]] = {}
        for forward in forwards:
            md = metadata.state_dict_metadata[forward.index.fqn]
            sizes = md.chunks.sizes_at(forward.index.offset)
            if sizes is None or math.prod(sizes) * md.dtype.itemsize != forward.nbytes:
                raise CheckpointError(f"checkpoint metadata of {forward.index.fqn!r} chunk "
                                      f"{forward.index.offset} is inconsistent")
            self._layout[forward.index] = (md.dtype, pieces(sizes, md.dtype.itemsize, piece_bytes))
        largest = max((p.end - p.start for _, cut in self._layout.values() for p in cut), default=0)
        self._buffer = torch.empty(largest, dtype=torch.uint8, device=device)
        self._status = torch.empty(STATUS_BYTES, dtype=torch.uint8, device=device)
        self._dests: Dict[int, torch.Tensor] = {}  # id(read item) -> its destination, while receiving

    def exchange(self, forwards: Sequence[Forward], held: Dict[MetadataIndex, memoryview],
                 failure: Optional[BaseException]) -> Optional[BaseException]:
        """Send the chunks of ``forwards`` this rank sources (fetched into ``held``) and receive
        the others, in order; returns the first failure: ``failure`` or one met here."""
        for forward in forwards:
            if forward.source == self._rank:
                failure = self._send(forward, held.get(forward.index), failure)
            else:
                failure = self._receive(forward, failure)
        return failure

    def _send(self, forward: Forward, data: Optional[memoryview],
              failure: Optional[BaseException]) -> Optional[BaseException]:
        key = forward.index.fqn
        if failure is None and (data is None or len(data) != forward.nbytes):
            failure = CheckpointError(f"{key} chunk {forward.index.offset} was not fetched whole for forwarding")
        for piece in self._layout[forward.index][1]:
            staged = None
            if failure is None:
                try:
                    staged = self._stage(data[piece.start:piece.end], key)
                except Exception as exc:  # noqa: BLE001 (sent as a FAILED status; raised after the exchange)
                    failure = exc
            self._status.copy_(_encode(failure))
            for target in forward.targets:
                dist.send(self._status, dst=target)
                if staged is not None:
                    dist.send(staged, dst=target)
            if staged is None:
                return failure
        return failure

    def _stage(self, data: memoryview, key: str) -> torch.Tensor:
        """``data`` in the piece buffer: through the pinned slabs on the copy stream, after the
        sends that read the buffer before; the caller's stream (the sends) after the copy."""
        with warnings.catch_warnings():  # read only: the fetched bytes are copied, never written
            warnings.simplefilter("ignore", UserWarning)
            source = torch.frombuffer(data, dtype=torch.uint8)
        target = self._buffer[:len(data)]
        self._bounce.after_current_work()
        self._bounce.copy(source, target, key)
        self._bounce.make_current_wait()
        return target

    def _receive(self, forward: Forward, failure: Optional[BaseException]) -> Optional[BaseException]:
        dtype, cut = self._layout[forward.index]
        for piece in cut:
            dist.recv(self._status, src=forward.source)
            message = _decode(self._status)
            if message is not None:
                self._dests.clear()
                return failure or CheckpointError(
                    f"rank {forward.source} could not fetch {forward.index.fqn} chunk {forward.index.offset} "
                    f"to forward it: {message}")
            data = self._buffer[:piece.end - piece.start]
            dist.recv(data, src=forward.source)
            if failure is None:
                try:
                    self._accept(forward.index, piece, data.view(dtype).view(piece.lengths))
                except Exception as exc:  # noqa: BLE001 (raised after the exchange)
                    failure = exc
        if failure is None:
            for item in self._received.get(forward.index, []):
                self._planner.apply_tensor(item, self._dests.pop(id(item)))
        self._dests.clear()
        return failure

    def _accept(self, index: MetadataIndex, piece: Piece, data: torch.Tensor) -> None:
        """Copy the part of each box this rank reads of chunk ``index`` that lies in ``piece``
        (``data``, on the exchange's device) into its destination."""
        box = ChunkStorageMetadata(piece.offsets, piece.lengths)
        for item in self._received.get(index, []):
            dest = self._dests.get(id(item))
            if dest is None:
                dest = self._dests[id(item)] = self._planner.acquire_tensor(item)
            common = overlap(ChunkStorageMetadata(tuple(item.storage_offsets), tuple(item.lengths)), box)
            if common is not None:
                in_dest, in_piece, lengths = common
                with torch.no_grad():
                    narrow(dest, in_dest, lengths).copy_(narrow(data, in_piece, lengths))
