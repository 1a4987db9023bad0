"""Cooperative verification: which rank checks which stored chunk during a load.

A chunk's crc32 covers the whole chunk, so checking it means reading all of it. When several
ranks each need only part of a chunk (a resharding load: a changed FSDP world size cuts
stored row ranges, ``Shard(0)`` -> ``Shard(1)`` gives every rank a column block of every
chunk), the chunk is read whole and checked by ONE of them; the others read only the bytes
they need. The coordinator assigns these duties while planning (one pass over the gathered
plans, balanced by the bytes each rank reads), and the check's outcome reaches every rank
through the result of the read step, which ``load`` gathers from every rank before it
returns: a corrupt chunk fails the load everywhere.

What is checked is the stored file, once: the ranks that read part of a chunk read the same
bytes of the same file (on one host, the same page cache) without checking them again.
A chunk some verifying rank reads whole anyway needs no duty: that read checks it.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections import defaultdict
from typing import Any, Dict, FrozenSet, List, NamedTuple, Optional, Sequence, Tuple

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.metadata import (
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from hyper_parallel.core.distributed_checkpoint.storage import StorageReader



class Verification(NamedTuple):
    """What the reader keeps in ``LoadPlan.storage_data`` from local to global plan and back."""

    verifying: bool
    """This rank checks checksums on this load."""
    assigned: bool
    """The coordinator has assigned ``duties`` (False in a local plan)."""
    duties: FrozenSet[MetadataIndex] = frozenset()
    """Chunks this rank needs part of and reads whole, to check them for every rank."""


def reads_whole(item: ReadItem, chunk_sizes: Sequence[int]) -> bool:
    """Whether ``item`` copies every element of its stored chunk."""
    return math.prod(item.lengths) == math.prod(chunk_sizes)


def mark_local_plan(plan: LoadPlan, verifying: bool) -> LoadPlan:
    """The local plan, telling the coordinator whether this rank verifies."""
    return dataclasses.replace(plan, storage_data=Verification(verifying, False))


def duties_of(plan: LoadPlan) -> Optional[FrozenSet[MetadataIndex]]:
    """The chunks ``plan``'s rank checks for the others, or None when no duties were assigned
    (then the rank checks every chunk it reads, whole or not)."""
    data = plan.storage_data
    return data.duties if isinstance(data, Verification) and data.assigned else None


def assign_duties(plans: List[LoadPlan], chunk_bytes: Dict[MetadataIndex, Tuple[int, int]]) -> List[LoadPlan]:
    """Coordinator: give each chunk that verifying ranks need only part of to one of them.

    Args:
        plans: every rank's local plan (from :func:`mark_local_plan`), in rank order.
        chunk_bytes: stored chunk -> (its bytes, bytes per element).

    The rank chosen is the one whose total read stays smallest (largest chunks first), so
    the extra reads spread over the ranks.
    """
    verifying = [isinstance(p.storage_data, Verification) and p.storage_data.verifying for p in plans]
    need: Dict[MetadataIndex, Dict[int, int]] = defaultdict(lambda: defaultdict(int))
    covered = set()
    load = [0] * len(plans)
    for rank, plan in enumerate(plans):
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                continue
            total, itemsize = chunk_bytes[item.storage_index]
            nbytes = math.prod(item.lengths) * itemsize
            load[rank] += nbytes
            if not verifying[rank]:
                continue
            if nbytes == total:
                covered.add(item.storage_index)
            need[item.storage_index][rank] += nbytes
    duties: List[set] = [set() for _ in plans]
    contested = sorted((index for index in need if index not in covered),
                       key=lambda index: (-chunk_bytes[index][0], index.fqn, index.offset))
    for index in contested:
        total = chunk_bytes[index][0]
        readers = need[index]
        rank = min(readers, key=lambda r: (load[r] + total - readers[r], r))
        load[rank] += total - readers[rank]
        duties[rank].add(index)
    return [dataclasses.replace(plan, storage_data=Verification(verifying[rank], True, frozenset(duties[rank])))
            for rank, plan in enumerate(plans)]


class VerifyingReader(StorageReader):
    """A reader of checkpoints of our format (whatever stores its files) that checks chunks
    cooperatively: each rank marks its plan, the coordinator assigns the duties above.
    Subclasses set ``verify``, say where a stored file is (:meth:`stored_at`) and read
    ``metadata`` / ``_verifying`` in ``execute_read``."""

    verify: bool = True
    metadata: Optional[Metadata] = None
    _verifying: bool = True
    stored_as: str = "file"
    """What a stored data file is called in messages (``file``, ``object``)."""

    @abc.abstractmethod
    def read_metadata(self) -> Metadata:
        """The checkpoint's committed metadata; works without a process group."""

    @abc.abstractmethod
    def stored_at(self, name: str) -> str:
        """Where the checkpoint's data file ``name`` is (a path or a URL), for messages."""

    def load_metadata(self, **kwargs: Any) -> Metadata:
        return self.read_metadata()

    def configure_reader(self, metadata: Metadata, is_coordinator: bool, **kwargs: Any) -> None:
        self.metadata = metadata
        self._verifying = self.verify and bool(kwargs.get("verify", True))

    def optimize_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return mark_local_plan(plan, self._verifying)

    def optimize_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        """Coordinator: assign the checks of chunks that ranks read only parts of."""
        chunk_bytes = {}
        for plan in plans:
            for item in plan.items:
                if item.type == LoadItemType.TENSOR and item.storage_index not in chunk_bytes:
                    md = self.metadata.state_dict_metadata[item.storage_index.fqn]
                    chunk_bytes[item.storage_index] = (self._storage(item.storage_index).length, md.dtype.itemsize)
        return assign_duties(plans, chunk_bytes)

    def _storage(self, index: MetadataIndex) -> StorageInfo:
        info = self.metadata.storage_data.get(index)
        if info is None:
            raise CheckpointError(f"checkpoint metadata has no storage location for {index}")
        return info

    def _chunk_sizes(self, item: ReadItem, info: StorageInfo) -> Tuple[int, ...]:
        """The sizes of the stored chunk ``item`` reads from, checked against its stored length."""
        key = item.storage_index.fqn
        md = self.metadata.state_dict_metadata[key]
        sizes = md.chunks.sizes_at(item.storage_index.offset) if isinstance(md, TensorStorageMetadata) else None
        if sizes is None or math.prod(sizes) * md.dtype.itemsize != info.length:
            raise CheckpointError(f"checkpoint metadata of {key!r} chunk {item.storage_index.offset} is inconsistent")
        return sizes

    def _check(self, crc: int, info: StorageInfo, what: str) -> None:
        """Raise naming the stored bytes of ``info`` (``what`` they hold) unless ``crc`` is theirs."""
        if crc != info.checksum:
            raise CheckpointError(
                f"checksum mismatch in {self.stored_at(info.relative_path)} bytes "
                f"{info.offset}..{info.offset + info.length} ({what}): the {self.stored_as} is corrupt"
            )

