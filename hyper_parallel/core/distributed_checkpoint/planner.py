"""Save and load planners: what each rank writes, what it reads, and where results go."""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyper_parallel.core.distributed_checkpoint.checksum import crc32
from hyper_parallel.core.distributed_checkpoint.flatten import flatten_state_dict, set_by_path
from hyper_parallel.core.distributed_checkpoint.metadata import (
    DTYPE_TO_SAFETENSORS,
    BytesStorageMetadata,
    CheckpointError,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.resharding import (
    local_chunk,
    local_data,
    narrow,
    numel,
    overlap,
    replica_ranks,
)
from hyper_parallel.core.distributed_checkpoint.values import encode_value


class WriteItemType(enum.Enum):
    TENSOR = "tensor"
    BYTE_IO = "byte_io"


LoadItemType = WriteItemType


@dataclass(frozen=True)
class TensorWriteData:
    """A tensor chunk to write: its global box plus the tensor's global size and dtype."""

    chunk: ChunkStorageMetadata
    dtype: torch.dtype
    size: Tuple[int, ...]


@dataclass(frozen=True)
class BytesIOWriteData:
    """A serialised non-tensor value: its length and encoding (``json`` / ``pickle``)."""

    nbytes: int
    encoding: str


@dataclass(frozen=True)
class WriteItem:
    index: MetadataIndex
    type: WriteItemType
    tensor_data: Optional[TensorWriteData] = None
    bytes_io_data: Optional[BytesIOWriteData] = None


@dataclass(frozen=True)
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
    def configure_planner(self, state_dict: Dict[str, Any], **kwargs: Any) -> None: ...

    @abc.abstractmethod
    def build_local_plan(self) -> SavePlan: ...

    @abc.abstractmethod
    def build_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]: ...

    @abc.abstractmethod
    def finalize_plan(self, plan: SavePlan) -> SavePlan: ...

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
    def configure_planner(self, state_dict: Dict[str, Any], metadata: Metadata, **kwargs: Any) -> None: ...

    @abc.abstractmethod
    def build_local_plan(self) -> LoadPlan: ...

    @abc.abstractmethod
    def build_global_plan(self, all_plans: List[LoadPlan]) -> List[LoadPlan]: ...

    @abc.abstractmethod
    def finalize_plan(self, plan: LoadPlan) -> LoadPlan: ...

    @abc.abstractmethod
    def acquire_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The destination view ``read_item`` is copied into."""

    @abc.abstractmethod
    def apply_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """Store ``tensor`` (the acquired view, or a tensor to copy into it)."""

    @abc.abstractmethod
    def apply_bytes(self, read_item: ReadItem, value: Any) -> None:
        """Store a decoded non-tensor value."""

    def broadcasts(self) -> List[Tuple[torch.Tensor, int, Any]]:
        """``(tensor, src_global_rank, group)`` fills to run after reading, in this order on
        every rank of each group: chunks read once and shared with replicas. None by default."""
        return []


def _crc_of_tensor(tensor: torch.Tensor) -> int:
    data = tensor.detach().contiguous().cpu()
    return crc32(data.reshape(-1).view(torch.uint8).numpy()) if data.numel() else 0


def _check_savable_tensor(key: str, value: torch.Tensor) -> None:
    if value.dtype not in DTYPE_TO_SAFETENSORS:
        raise TypeError(f"tensor {key!r} has dtype {value.dtype}, which safetensors cannot store")
    if isinstance(value, DTensor) and any(p.is_partial() for p in value.placements):
        raise ValueError(
            f"DTensor {key!r} has a Partial placement {value.placements}; redistribute it to "
            "Replicate/Shard before saving"
        )


class StandardSavePlanner(SavePlanner):
    """Writes every DTensor chunk once (Replicate copies deduplicated), and every plain
    tensor and non-tensor value once, from the lowest rank that holds its key.

    A plain tensor or value is one value per key for the whole job (torch DCP's contract:
    rank 0's copy is saved for keys every rank holds). Each rank reports a crc32 of every
    plain value in its plan (``value_checksums``) and ``save`` refuses, naming the key, a key
    whose value differs between ranks (:func:`check_values_agree`); per-rank data goes under
    rank-specific keys. With ``use_collectives=False`` every rank writes its plain values
    and loading compares the copies instead.

    Replicated chunks are assigned without communication: every replica enumerates the
    same chunks in key order and gives each to the replica with the fewest bytes so far
    (``save_to_minimum_rank``: to the lowest rank).
    """

    def __init__(self) -> None:
        self.state_dict: Dict[str, Any] = {}
        self.flat: Dict[str, Any] = {}
        self._encoded: Dict[str, bytes] = {}
        self._plain_tensor_checksums: Dict[str, int] = {}

    def configure_planner(
        self,
        state_dict: Dict[str, Any],
        *,
        rank: int = 0,
        remove_redundancy: bool = True,
        save_to_minimum_rank: bool = False,
        allow_pickle: bool = False,
        use_collectives: bool = True,
        **kwargs: Any,
    ) -> None:
        self.state_dict = state_dict
        self.global_view = use_collectives
        self.flat, _ = flatten_state_dict(state_dict)
        self.rank = rank
        self.remove_redundancy, self.save_to_minimum_rank = remove_redundancy, save_to_minimum_rank
        self.allow_pickle = allow_pickle

    def build_local_plan(self) -> SavePlan:
        items: List[WriteItem] = []
        layouts: Dict[str, Dict[str, Any]] = {}
        checksums: Dict[str, int] = {}
        replica_load: Dict[Tuple[int, ...], Dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self._encoded = {}
        for key in sorted(self.flat):
            value = self.flat[key]
            if isinstance(value, DTensor):
                _check_savable_tensor(key, value)
                item = self._dtensor_item(key, value, replica_load)
                if item is not None:
                    items.append(item)
                    layouts[key] = {
                        "mesh_shape": list(value.device_mesh.shape),
                        "mesh_dim_names": list(value.device_mesh.mesh_dim_names or ()),
                        "placements": [str(p) for p in value.placements],
                    }
            elif isinstance(value, torch.Tensor):
                _check_savable_tensor(key, value)
                checksums[key] = _crc_of_tensor(value)
                chunk = local_chunk(value)
                items.append(WriteItem(MetadataIndex(key, chunk.offsets), WriteItemType.TENSOR,
                                       TensorWriteData(chunk, value.dtype, tuple(value.shape))))
            else:
                data, encoding = encode_value(value, key, allow_pickle=self.allow_pickle)
                checksums[key] = crc32(data)
                self._encoded[key] = data
                items.append(WriteItem(MetadataIndex(key), WriteItemType.BYTE_IO,
                                       bytes_io_data=BytesIOWriteData(len(data), encoding)))
        self._plain_tensor_checksums = {k: checksums[k] for k in checksums if k not in self._encoded}
        return SavePlan(items, layouts=layouts, value_checksums=checksums)

    def _dtensor_item(self, key: str, value: DTensor, replica_load) -> Optional[WriteItem]:
        size = tuple(value.shape)
        chunk = local_chunk(value)
        index: Optional[int] = None
        if numel(size) == 0:
            # Nobody holds a non-empty chunk; the lowest rank of the mesh records the shape.
            if self.rank != int(value.device_mesh.mesh.min()):
                return None
            chunk = ChunkStorageMetadata((0,) * len(size), size)
        elif numel(chunk.sizes) == 0:
            return None
        else:
            holders = replica_ranks(value)
            if self.remove_redundancy:
                if self.save_to_minimum_rank:
                    owner = min(holders)
                else:
                    load = replica_load[tuple(holders)]
                    owner = min(holders, key=lambda r: (load[r], holders.index(r)))
                    load[owner] += numel(chunk.sizes) * value.element_size()
                if owner != self.rank:
                    return None
            else:
                position = sorted(holders).index(self.rank)
                index = position or None
        return WriteItem(MetadataIndex(key, chunk.offsets, index), WriteItemType.TENSOR,
                         TensorWriteData(chunk, value.dtype, size))

    def build_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        state_md: Dict[str, Any] = {}
        layouts: Dict[str, Dict[str, Any]] = {}
        seen: Dict[MetadataIndex, int] = {}
        plans = []
        for rank, plan in enumerate(all_plans):
            layouts.update(plan.layouts)
            kept = []
            for item in plan.items:
                if item.index in seen:
                    if item.index.fqn in plan.value_checksums:
                        continue  # a plain value: the lowest rank holding it writes it
                    raise CheckpointError(f"ranks {seen[item.index]} and {rank} both planned to write {item.index}")
                seen[item.index] = rank
                kept.append(item)
                self._add_to_metadata(state_md, item)
            plans.append(dataclasses.replace(plan, items=kept))
        for fqn, md in state_md.items():
            if isinstance(md, TensorStorageMetadata):
                md.chunks.sort(key=lambda c: c.offsets)
                covered = sum(numel(c.sizes) for c in md.chunks)
                if self.global_view and numel(md.size) and covered != numel(md.size):
                    raise CheckpointError(
                        f"the saved chunks of {fqn!r} cover {covered} of {numel(md.size)} elements; "
                        "ranks hold inconsistent layouts of this tensor"
                    )
        return plans, Metadata(state_dict_metadata=state_md, layouts=layouts, world_size=len(all_plans))

    @staticmethod
    def _add_to_metadata(state_md: Dict[str, Any], item: WriteItem) -> None:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            if state_md.setdefault(fqn, BytesStorageMetadata()) != BytesStorageMetadata():
                raise CheckpointError(f"{fqn!r} is a tensor on one rank and a plain value on another")
            return
        td = item.tensor_data
        md = state_md.setdefault(fqn, TensorStorageMetadata(td.dtype, td.size))
        if not isinstance(md, TensorStorageMetadata) or (md.dtype, md.size) != (td.dtype, td.size):
            raise CheckpointError(f"ranks disagree on tensor {fqn!r}: {md} vs dtype {td.dtype} size {td.size}")
        if item.index.index is None:
            md.chunks.append(td.chunk)

    def finalize_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def get_data(self, item: WriteItem) -> Any:
        if item.type == WriteItemType.BYTE_IO:
            return self._encoded[item.index.fqn]
        data = local_data(self.flat[item.index.fqn]).detach()
        if not data.numel():  # a zero-element tensor is recorded as one chunk of its global shape
            return data.new_empty(item.tensor_data.chunk.sizes)
        return data.contiguous()

    def known_checksum(self, item: WriteItem) -> Optional[int]:
        """Plain tensors were checksummed in planning (for the cross-rank agreement check)."""
        if type(self).get_data is not StandardSavePlanner.get_data:
            return None  # a subclass may serve other bytes than the ones checksummed
        return self._plain_tensor_checksums.get(item.index.fqn) if item.type == WriteItemType.TENSOR else None


def check_values_agree(checksums: Sequence[Dict[str, int]]) -> None:
    """Refuse plain tensors/values whose key holds different values on different ranks.

    ``checksums[r]`` is rank r's ``SavePlan.value_checksums``. Raises:
        CheckpointError: naming the key and two ranks that disagree.
    """
    first: Dict[str, Tuple[int, int]] = {}
    for rank, values in enumerate(checksums):
        for key, crc in values.items():
            holder, reference = first.setdefault(key, (rank, crc))
            if reference != crc:
                raise CheckpointError(
                    f"plain value {key!r} differs between rank {holder} and rank {rank}; a plain "
                    "tensor or value is one value for the whole job: make it a DTensor or store "
                    f"per-rank values under rank-specific keys (e.g. '{key}.rank{rank}')"
                )


class StandardLoadPlanner(LoadPlanner):
    """Loads every key of the state dict in place, resharding from any saved layout.

    Args:
        strict: missing keys and shape/dtype mismatches raise :class:`CheckpointError`
            naming the key. With ``strict=False`` they are recorded in ``missing_keys`` and
            ``mismatched_keys`` and left untouched. Checkpoint keys the state dict does not
            ask for are always just recorded in ``unexpected_keys``.
    """

    def __init__(self, strict: bool = True) -> None:
        self.strict = strict
        self.missing_keys: List[str] = []
        self.unexpected_keys: List[str] = []
        self.mismatched_keys: List[str] = []
        self._broadcasts: List[Tuple[torch.Tensor, int, Any]] = []
        self._broadcast_keys: List[Tuple[str, int, Tuple[int, ...]]] = []

    def configure_planner(self, state_dict: Dict[str, Any], metadata: Metadata, *,
                          rank: int = 0, use_collectives: bool = True, **kwargs: Any) -> None:
        self.state_dict, self.metadata = state_dict, metadata
        self.flat, self.paths = flatten_state_dict(state_dict)
        self.rank, self.use_collectives = rank, use_collectives

    def _problem(self, key: str, kind: List[str], message: str) -> None:
        if self.strict:
            raise CheckpointError(message)
        kind.append(key)

    def build_local_plan(self) -> LoadPlan:
        self.missing_keys, self.mismatched_keys, self._broadcasts, self._broadcast_keys = [], [], [], []
        self.unexpected_keys = sorted(set(self.metadata.state_dict_metadata) - set(self.flat))
        items: List[ReadItem] = []
        for key in sorted(self.flat):
            value = self.flat[key]
            md = self.metadata.state_dict_metadata.get(key)
            if md is None:
                self._problem(key, self.missing_keys, f"key {key!r} is not in the checkpoint")
            elif not isinstance(value, torch.Tensor):
                if isinstance(md, TensorStorageMetadata):
                    self._problem(key, self.mismatched_keys,
                                  f"key {key!r} is a tensor in the checkpoint but not in the state dict")
                else:
                    items.append(ReadItem(LoadItemType.BYTE_IO, MetadataIndex(key), (), MetadataIndex(key), (), ()))
            elif not isinstance(md, TensorStorageMetadata):
                self._problem(key, self.mismatched_keys,
                              f"key {key!r} is a tensor in the state dict but not in the checkpoint")
            elif tuple(value.shape) != md.size or value.dtype != md.dtype:
                self._problem(
                    key, self.mismatched_keys,
                    f"key {key!r}: the state dict has shape {tuple(value.shape)} dtype {value.dtype}, "
                    f"the checkpoint has shape {md.size} dtype {md.dtype}",
                )
            else:
                items.extend(self._tensor_reads(key, value, md))
        return LoadPlan(items, planner_data=list(self._broadcast_keys))

    def _tensor_reads(self, key: str, value: torch.Tensor, md: TensorStorageMetadata) -> List[ReadItem]:
        dest = local_chunk(value)
        if self._receives_by_broadcast(key, value):
            return []
        reads, covered = [], 0
        for stored in md.chunks:
            common = overlap(dest, stored)
            if common is None:
                continue
            dest_offsets, storage_offsets, lengths = common
            covered += numel(lengths)
            reads.append(ReadItem(LoadItemType.TENSOR, MetadataIndex(key, dest.offsets), dest_offsets,
                                  MetadataIndex(key, stored.offsets), storage_offsets, lengths))
        if covered != numel(dest.sizes):
            raise CheckpointError(
                f"the checkpoint holds {covered} of the {numel(dest.sizes)} elements of {key!r} "
                f"this rank needs (box offsets {dest.offsets} sizes {dest.sizes}): a chunk is missing"
            )
        return reads

    def _receives_by_broadcast(self, key: str, value: torch.Tensor) -> bool:
        """Replicated shards are read by the first replica along the first Replicate mesh dim
        and broadcast to the others; returns True on the receiving replicas."""
        if not (self.use_collectives and isinstance(value, DTensor)) or value.device_mesh.get_coordinate() is None:
            return False
        mesh = value.device_mesh
        dims = [d for d, p in enumerate(value.placements) if p.is_replicate() and mesh.size(d) > 1]
        if not dims:
            return False
        dim = dims[0]
        coord = mesh.get_coordinate()
        src_index = tuple(0 if d == dim else c for d, c in enumerate(coord))
        src = int(mesh.mesh[src_index])
        group = mesh.get_group(dim)
        self._broadcasts.append((local_data(value).detach(), src, group))
        self._broadcast_keys.append((key, src, tuple(dist.get_process_group_ranks(group))))
        return src != self.rank

    def build_global_plan(self, all_plans: List[LoadPlan]) -> List[LoadPlan]:
        """Check that every rank will join the same replica broadcasts in the same order (a
        mismatch, from state dicts that differ between replicas, would otherwise hang)."""
        def by_group(plan: LoadPlan) -> Dict[Tuple[int, ...], Tuple[int, List[str]]]:
            sequences: Dict[Tuple[int, ...], Tuple[int, List[str]]] = {}
            for key, src, group in plan.planner_data or ():
                sequences.setdefault(group, (src, []))[1].append(key)
            return sequences

        sequences = [by_group(plan) for plan in all_plans]
        for rank, mine in enumerate(sequences):
            for group, (src, keys) in mine.items():
                if sequences[src].get(group, (src, []))[1] != keys:
                    raise CheckpointError(
                        f"rank {rank} and rank {src} would broadcast different replicated shards in "
                        f"group {list(group)} (their state dicts hold different DTensor keys)"
                    )
        return all_plans

    def finalize_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def acquire_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = local_data(self.flat[read_item.dest_index.fqn]).detach()  # parameters are filled in place
        return narrow(dest, read_item.dest_offsets, read_item.lengths)

    def apply_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        dest = self.acquire_tensor(read_item)
        if tensor.data_ptr() != dest.data_ptr() or tensor.stride() != dest.stride():
            with torch.no_grad():
                dest.copy_(tensor)

    def apply_bytes(self, read_item: ReadItem, value: Any) -> None:
        key = read_item.dest_index.fqn
        self.flat[key] = value
        set_by_path(self.state_dict, self.paths[key], value)

    def broadcasts(self) -> List[Tuple[torch.Tensor, int, Any]]:
        return list(self._broadcasts)
