"""Load planning on each rank: what to read from which stored chunk and where it lands
(``StandardLoadPlanner``), resharding from any saved layout."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch
from torch.distributed.tensor import DTensor

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.flatten import flatten_state_dict, set_by_path
from hyper_parallel.core.distributed_checkpoint.format.geometry import narrow, overlap
from hyper_parallel.core.distributed_checkpoint.format.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from hyper_parallel.core.distributed_checkpoint.planning.shards import local_chunk, local_data, mesh_slot


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
        self._locals: Dict[str, torch.Tensor] = {}

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
        for position in md.chunks.overlapping(dest.offsets, dest.sizes):  # indexed: not every chunk
            stored = md.chunks[position]
            dest_offsets, storage_offsets, lengths = overlap(dest, stored)
            covered += math.prod(lengths)
            reads.append(ReadItem(LoadItemType.TENSOR, MetadataIndex(key, dest.offsets), dest_offsets,
                                  MetadataIndex(key, stored.offsets), storage_offsets, lengths))
        if covered != math.prod(dest.sizes):
            raise CheckpointError(
                f"the checkpoint holds {covered} of the {math.prod(dest.sizes)} elements of {key!r} "
                f"this rank needs (box offsets {dest.offsets} sizes {dest.sizes}): a chunk is missing"
            )
        return reads

    def _receives_by_broadcast(self, key: str, value: torch.Tensor) -> bool:
        """Replicated shards are read by the first replica along the first Replicate mesh dim
        and broadcast to the others; returns True on the receiving replicas."""
        if not (self.use_collectives and isinstance(value, DTensor)):
            return False
        slot = mesh_slot(value)
        if slot.broadcast_dim is None:
            return False
        src = slot.broadcast_ranks[0]
        self._broadcasts.append((local_data(value).detach(), src, value.device_mesh.get_group(slot.broadcast_dim)))
        self._broadcast_keys.append((key, src, slot.broadcast_ranks))
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

    def _local(self, key: str) -> torch.Tensor:
        """The tensor holding this rank's part of ``key`` (found once per load: a DTensor's
        ``to_local`` costs an autograd call, and every read asks twice)."""
        local = self._locals.get(key)
        if local is None:
            local = self._locals[key] = local_data(self.flat[key]).detach()  # parameters are filled in place
        return local

    def acquire_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return narrow(self._local(read_item.dest_index.fqn), read_item.dest_offsets, read_item.lengths)

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
