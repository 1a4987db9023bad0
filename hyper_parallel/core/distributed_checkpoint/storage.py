"""Storage interfaces: where a save's bytes go and where a load's bytes come from, and
:class:`ChunkSource`, where a writer gets the tensor bytes it writes."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

import torch

from hyper_parallel.core.distributed_checkpoint.format.metadata import FileInfo, Metadata, MetadataIndex, StorageInfo
from hyper_parallel.core.distributed_checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItem


@dataclass(frozen=True)
class WriteResult:
    """Where one written item ended up."""

    index: MetadataIndex
    storage: StorageInfo


@dataclass
class RankWriteResult:
    """Everything one rank wrote: its items and its files (name -> size/checksum)."""

    items: List[WriteResult]
    files: Dict[str, FileInfo]


class StorageWriter(abc.ABC):
    """Writes one checkpoint. Order on every rank: ``initialize_writer`` -> ``configure_writer``
    -> ``optimize_local_plan`` -> (coordinator) ``optimize_global_plan`` -> ``execute_write``
    -> (coordinator) ``finalize_checkpoint``; after a failed collective save the coordinator
    calls ``abort_checkpoint`` instead."""

    allow_pickle: bool = False
    """Whether values JSON cannot hold may be pickled (the planner is told before planning)."""

    @abc.abstractmethod
    def initialize_writer(self, checkpoint_id: Optional[str]) -> None: ...

    @abc.abstractmethod
    def configure_writer(self, is_coordinator: bool, **kwargs: Any) -> None: ...

    def optimize_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def optimize_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        return plans

    @abc.abstractmethod
    def execute_write(self, plan: SavePlan, planner: SavePlanner) -> RankWriteResult: ...

    @abc.abstractmethod
    def finalize_checkpoint(self, metadata: Metadata, results: List[RankWriteResult]) -> None:
        """Record ``results`` in ``metadata`` and commit the checkpoint (coordinator only)."""

    def abort_checkpoint(self, plan: SavePlan) -> None:
        """Coordinator, after a failed collective save (every rank has stopped writing):
        clean up what the save left. Nothing by default."""


class AsyncCommitWriter(StorageWriter):
    """A writer that can commit a collective save without collectives, from a background
    thread (what :func:`async_save` needs). After ``execute_write`` every rank calls
    ``publish_result`` (or ``publish_failure``); the coordinator then calls
    ``collect_results`` and ``finalize_checkpoint``, the others ``wait_committed``."""

    @abc.abstractmethod
    def publish_result(self, plan: SavePlan, result: RankWriteResult) -> None:
        """Make this rank's write results visible to the coordinator."""

    @abc.abstractmethod
    def publish_failure(self, plan: SavePlan, error: BaseException) -> None:
        """Tell the other ranks (best effort) that this rank's part failed."""

    @abc.abstractmethod
    def collect_results(self, plan: SavePlan) -> List[RankWriteResult]:
        """Coordinator: every rank's published results, in rank order (bounded wait)."""

    @abc.abstractmethod
    def wait_committed(self, plan: SavePlan) -> Metadata:
        """Non-coordinators: block until the coordinator committed this save (bounded wait);
        returns the committed metadata."""


class StorageReader(abc.ABC):
    """Reads one checkpoint. Order: ``initialize_reader`` -> ``load_metadata`` (coordinator) ->
    ``configure_reader`` -> ``optimize_local_plan`` -> ``optimize_global_plan`` -> ``execute_read``."""

    @abc.abstractmethod
    def initialize_reader(self, checkpoint_id: Optional[str]) -> None: ...

    @abc.abstractmethod
    def load_metadata(self, **kwargs: Any) -> Metadata: ...

    @abc.abstractmethod
    def configure_reader(self, metadata: Metadata, is_coordinator: bool, **kwargs: Any) -> None: ...

    def optimize_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def optimize_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    @abc.abstractmethod
    def execute_read(self, plan: LoadPlan, planner: LoadPlanner) -> None: ...


class ChunkSource(abc.ABC):
    """Where a writer gets the bytes of the tensor chunks it writes."""

    @abc.abstractmethod
    def chunks(self, item: WriteItem) -> Iterator[torch.Tensor]:
        """The bytes of TENSOR ``item`` as consecutive host uint8 tensors, in order. Each is
        valid until the next one is requested (its memory is then reused)."""

    @abc.abstractmethod
    def known_checksum(self, item: WriteItem) -> Optional[int]:
        """crc32 of the item's bytes if already known, else None."""

    @abc.abstractmethod
    def abort(self, error: BaseException) -> None:
        """A writer failed: stop producing and wake every consumer with ``error``."""


class DirectChunks(ChunkSource):
    """A planner's chunks used directly (a writer called without staging): each chunk is
    fetched and moved to host memory when it is written."""

    def __init__(self, planner: SavePlanner) -> None:
        self._planner = planner

    def chunks(self, item: WriteItem) -> Iterator[torch.Tensor]:
        yield self._planner.get_data(item).detach().cpu().contiguous().reshape(-1).view(torch.uint8)

    def known_checksum(self, item: WriteItem) -> Optional[int]:
        return self._planner.known_checksum(item)

    def abort(self, error: BaseException) -> None:
        """Nothing runs ahead of the writer."""
