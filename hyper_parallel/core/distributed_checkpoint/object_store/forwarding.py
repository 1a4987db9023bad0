"""Chunks fetched once from the store and forwarded between ranks during a resharding load.

When several ranks need parts of one stored chunk (``Shard(0)`` -> ``Shard(1)`` gives every
rank a column block of every chunk, and a column block spans all the chunk's rows), fetching
their parts from an object store costs each of them the whole chunk. Instead the coordinator
names one *source* per such chunk (the rank that checks its crc32, else the one needing most of
it) which fetches it whole and sends it to the others over the process group: every stored
byte is fetched once in all (GETs are what object stores charge and throttle).

The exchange runs in *rounds* of at most ``round_bytes`` of chunks (what a source holds at
once), in the same global order on every rank: a source sends each chunk to its targets in
turn (a status first, then the bytes), a target receives; blocking sends and receives in one
global order cannot deadlock. A source whose fetch failed (or that failed earlier) sends a
failure status instead, so no rank waits forever; every rank raises after the exchange.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.metadata import MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlan
from hyper_parallel.core.distributed_checkpoint.planning.verify_plan import Verification


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


def plan_forwards(plans: List[LoadPlan], chunk_bytes: Callable[[MetadataIndex], int],
                  round_bytes: int) -> List[LoadPlan]:
    """Coordinator: name a source for each chunk that two or more ranks need part of.

    ``plans`` carry :class:`Verification` data (duties assigned); the source is the rank
    checking the chunk, else the one needing most of its bytes (the lowest such rank).
    """
    needed: Dict[MetadataIndex, Dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for rank, plan in enumerate(plans):
        for item in plan.items:
            if item.type == LoadItemType.TENSOR:
                needed[item.storage_index][rank] += _elements(item.lengths)
    checker = {index: rank for rank, plan in enumerate(plans) if isinstance(plan.storage_data, Verification)
               for index in plan.storage_data.duties}
    per_rank: List[List[Forward]] = [[] for _ in plans]
    round_no, in_round = 0, 0
    for index in sorted((i for i, ranks in needed.items() if len(ranks) > 1), key=lambda i: (i.fqn, i.offset)):
        ranks = needed[index]
        source = checker.get(index, min(ranks, key=lambda r: (-ranks[r], r)))
        nbytes = chunk_bytes(index)
        if not nbytes:
            continue
        if in_round and in_round + nbytes > round_bytes:
            round_no, in_round = round_no + 1, 0
        in_round += nbytes
        forward = Forward(index, source, tuple(sorted(r for r in ranks if r != source)), nbytes, round_no)
        for rank in (source, *forward.targets):
            per_rank[rank].append(forward)
    return [LoadPlan(plan.items, ForwardingPlan(plan.storage_data, tuple(per_rank[rank])), plan.planner_data)
            for rank, plan in enumerate(plans)]


def _elements(lengths: Sequence[int]) -> int:
    n = 1
    for length in lengths:
        n *= length
    return n


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


_OK, _FAILED = 0, 1


def exchange(forwards: Sequence[Forward], rank: int, held: Dict[MetadataIndex, memoryview],
             failure: Optional[BaseException], device: torch.device,
             receive: Callable[[Forward, memoryview], None]) -> Optional[BaseException]:
    """Send the chunks of ``forwards`` this rank sources (from ``held``) and ``receive`` those it
    targets, in order. A source sends a failure status for what it does not hold or when
    ``failure`` is set; a target keeps receiving after a failure (its sources must not wait).
    Returns the first failure met here (a source's report, or what ``receive`` raised)."""
    reported: Optional[BaseException] = None
    for forward in forwards:
        status = torch.zeros(1, dtype=torch.int64, device=device)
        if forward.source == rank:
            data = held.get(forward.index)
            ok = failure is None and data is not None and len(data) == forward.nbytes
            status.fill_(_OK if ok else _FAILED)
            payload = None
            if ok:
                with warnings.catch_warnings():  # read only: the buffer is sent, never written
                    warnings.simplefilter("ignore", UserWarning)
                    payload = torch.frombuffer(data, dtype=torch.uint8).to(device)
            for target in forward.targets:
                dist.send(status, dst=target)
                if payload is not None:
                    dist.send(payload, dst=target)
            continue
        dist.recv(status, src=forward.source)
        if int(status.item()) != _OK:
            reported = reported or CheckpointError(f"rank {forward.source} could not fetch {forward.index.fqn} "
                                                   f"chunk {forward.index.offset} to forward it (see its error)")
            continue
        buffer = torch.empty(forward.nbytes, dtype=torch.uint8, device=device)
        dist.recv(buffer, src=forward.source)
        if reported is None and failure is None:
            try:
                receive(forward, memoryview(buffer.cpu().numpy()).cast("B"))
            except Exception as exc:  # noqa: BLE001 (raised after the exchange)
                reported = exc
    return reported
