"""The planning contract: the items and plans a save writes and a load reads, and the planner
interfaces that produce them (:class:`SavePlanner`, :class:`LoadPlanner`).

The standard planners live in ``save_planner`` (each rank's writes), ``global_save_plan``
(the coordinator's merge into the checkpoint's metadata) and ``load_planner`` (each rank's
reads, resharding from any saved layout).
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from hyper_parallel.core.distributed_checkpoint.format.metadata import ChunkStorageMetadata, Metadata, MetadataIndex


class WriteItemType(enum.Enum):
    TENSOR = "tensor"
    BYTE_IO = "byte_io"


LoadItemType = WriteItemType


@dataclass(frozen=True, slots=True)
class TensorWriteData:
    """A tensor chunk to write: its global box plus the tensor's global size and dtype."""

    chunk: ChunkStorageMetadata
    dtype: torch.dtype
    size: Tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BytesIOWriteData:
    """A serialised non-tensor value: its length and encoding (``json`` / ``pickle``)."""

    nbytes: int
    encoding: str


@dataclass(frozen=True, slots=True)
class WriteItem:
    index: MetadataIndex
    type: WriteItemType
    tensor_data: Optional[TensorWriteData] = None
    bytes_io_data: Optional[BytesIOWriteData] = None


@dataclass(frozen=True, slots=True)
class ReadItem:
    """Copy box ``storage_offsets``/``lengths`` of stored chunk ``storage_index`` into the
    destination chunk ``dest_index`` at ``dest_offsets`` (offsets relative to each chunk)."""

    type: LoadItemType
    dest_index: MetadataIndex
    dest_offsets: Tuple[int, ...]
    storage_index: MetadataIndex
    storage_offsets: Tuple[int, ...]
    lengths: Tuple[int, ...]


@dataclass
class SavePlan:
    """One rank's writes. ``value_checksums`` (crc32 of every plain tensor and value this rank
    holds, owned or not) lets the coordinator refuse silently diverging per-rank values; it
    is not part of plan equality, so an unchanged structure still hits the plan cache.
    ``save_id`` (set by the coordinator for each save) is the same on every rank's plan."""

    items: List[WriteItem]
    layouts: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    storage_data: Any = field(default=None, compare=False)
    planner_data: Any = None
    value_checksums: Dict[str, int] = field(default_factory=dict, compare=False)
    save_id: str = field(default="", compare=False)


@dataclass
class LoadPlan:
    items: List[ReadItem]
    storage_data: Any = None
    planner_data: Any = None


class SavePlanner(abc.ABC):
    """Decides what a save writes. Called in this order on every rank:
    ``configure_planner`` -> ``build_local_plan`` -> (coordinator) ``build_global_plan`` ->
    ``finalize_plan`` -> ``get_data`` per item while writing."""

    @abc.abstractmethod
    def configure_planner(self, state_dict: Dict[str, Any], **kwargs: Any) -> None:
        """Take the flattened-to-be ``state_dict`` of this save (Stateful values already
        resolved to their state dicts). Keyword arguments ``save`` passes: ``rank``,
        ``is_coordinator``, ``remove_redundancy``, ``save_to_minimum_rank``, ``allow_pickle``
        (the writer's) and ``use_collectives``; a planner ignores those it does not use."""

    @abc.abstractmethod
    def build_local_plan(self) -> SavePlan:
        """This rank's :class:`SavePlan`: a :class:`WriteItem` per chunk or value it holds (and
        writes: which replica writes a replicated chunk is decided here, without
        communication), its DTensors' layouts and the crc32 of every plain value it holds."""

    @abc.abstractmethod
    def build_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        """Coordinator only: every rank's local plan in, each rank's plan to write and the
        checkpoint's :class:`Metadata` (without storage locations yet) out. Refuses plain values
        that differ between ranks (``CheckpointError`` naming the key and two ranks)."""

    @abc.abstractmethod
    def finalize_plan(self, plan: SavePlan) -> SavePlan:
        """Every rank, with the plan the coordinator sent it (``save_id`` set): the plan the
        writer executes. Planners that stage their data prepare it here."""

    @abc.abstractmethod
    def get_data(self, item: WriteItem) -> Any:
        """The contiguous tensor chunk (TENSOR) or the serialised bytes (BYTE_IO) of ``item``."""

    def known_checksum(self, item: WriteItem) -> Optional[int]:
        """crc32 of ``get_data(item)``'s bytes if the planner already computed it, so writers
        need not checksum them again; None (the default) when unknown."""
        return None


class LoadPlanner(abc.ABC):
    """Decides what a load reads and where it lands: ``configure_planner`` ->
    ``build_local_plan`` -> (coordinator) ``build_global_plan`` -> ``finalize_plan`` ->
    ``acquire_tensor``/``apply_tensor``/``apply_bytes`` per item while reading."""

    @abc.abstractmethod
    def configure_planner(self, state_dict: Dict[str, Any], metadata: Metadata, **kwargs: Any) -> None:
        """Take the ``state_dict`` to fill in place and the checkpoint's ``metadata`` (the same
        on every rank). Keyword arguments ``load`` passes: ``rank``, ``is_coordinator`` and
        ``use_collectives``; a planner ignores those it does not use."""

    @abc.abstractmethod
    def build_local_plan(self) -> LoadPlan:
        """This rank's :class:`LoadPlan`: a :class:`ReadItem` per overlap of a stored chunk with
        a destination this rank holds (any saved layout onto any current one), and one per
        value. Missing keys and shape or dtype mismatches raise ``CheckpointError`` naming the
        key, or are recorded by a lenient planner."""

    @abc.abstractmethod
    def build_global_plan(self, all_plans: List[LoadPlan]) -> List[LoadPlan]:
        """Coordinator only: every rank's local plan in, each rank's plan out (e.g. checked
        that the replicas of a group will run the same broadcasts)."""

    @abc.abstractmethod
    def finalize_plan(self, plan: LoadPlan) -> LoadPlan:
        """Every rank, with the plan the coordinator sent it: the plan the reader executes."""

    @abc.abstractmethod
    def acquire_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The destination view ``read_item`` is copied into (of the box's ``lengths``); the
        reader fills it in place or copies into it, then calls :meth:`apply_tensor`. May be
        called from several reader threads, for different boxes."""

    @abc.abstractmethod
    def apply_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Store ``tensor`` (the acquired view once filled, or a tensor to copy into it); called
        once per tensor item, after its bytes were checked where the read verifies them."""

    @abc.abstractmethod
    def apply_bytes(self, read_item: ReadItem, value: Any) -> None:
        """Store the decoded non-tensor ``value`` of ``read_item`` (replacing it in its container)."""

    def broadcasts(self) -> List[Tuple[torch.Tensor, int, Any]]:
        """``(tensor, src_global_rank, group)`` fills to run after reading, in this order on
        every rank of each group: chunks read once and shared with replicas. None by default."""
        return []
