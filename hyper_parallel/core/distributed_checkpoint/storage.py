"""Storage interfaces: where a save's bytes go and where a load's bytes come from."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from hyper_parallel.core.distributed_checkpoint.metadata import FileInfo, Metadata, MetadataIndex, StorageInfo
from hyper_parallel.core.distributed_checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner


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
    -> (coordinator) ``finalize_checkpoint``."""

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
