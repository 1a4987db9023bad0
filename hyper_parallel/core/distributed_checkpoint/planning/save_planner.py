"""Save planning on each rank: which chunks and values this rank writes (``StandardSavePlanner``)."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor

from hyper_parallel.core.distributed_checkpoint.format.checksum import crc32
from hyper_parallel.core.distributed_checkpoint.format.flatten import flatten_state_dict
from hyper_parallel.core.distributed_checkpoint.planning.global_save_plan import build_global_save_plan
from hyper_parallel.core.distributed_checkpoint.format.metadata import (
    DTYPE_TO_SAFETENSORS,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
)
from hyper_parallel.core.distributed_checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from hyper_parallel.core.distributed_checkpoint.format.values import encode_value
from hyper_parallel.core.distributed_checkpoint.planning.shards import local_chunk, local_data, mesh_slot


_UNCHECKED = -1  # a plain tensor's entry in a rank-local plan's value_checksums (no crc32 is negative)


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
    and loading compares the copies instead (plain tensors are then checksummed by the
    writer, not in planning).

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
                # Compared between ranks in a global plan; a rank-local one checksums as it writes
                # (an async save then keeps the whole pass off the caller's thread).
                checksums[key] = _crc_of_tensor(value) if self.global_view else _UNCHECKED
                chunk = local_chunk(value)
                items.append(WriteItem(MetadataIndex(key, chunk.offsets), WriteItemType.TENSOR,
                                       TensorWriteData(chunk, value.dtype, tuple(value.shape))))
            else:
                data, encoding = encode_value(value, key, allow_pickle=self.allow_pickle)
                checksums[key] = crc32(data)
                self._encoded[key] = data
                items.append(WriteItem(MetadataIndex(key), WriteItemType.BYTE_IO,
                                       bytes_io_data=BytesIOWriteData(len(data), encoding)))
        self._plain_tensor_checksums = {k: crc for k, crc in checksums.items()
                                        if k not in self._encoded and crc != _UNCHECKED}
        return SavePlan(items, layouts=layouts, value_checksums=checksums)

    def _dtensor_item(self, key: str, value: DTensor, replica_load) -> Optional[WriteItem]:
        size = tuple(value.shape)
        chunk = local_chunk(value)
        index: Optional[int] = None
        if math.prod(size) == 0:
            # Nobody holds a non-empty chunk; the lowest rank of the mesh records the shape.
            if self.rank != mesh_slot(value).lowest:
                return None
            chunk = ChunkStorageMetadata((0,) * len(size), size)
        elif math.prod(chunk.sizes) == 0:
            return None
        else:
            holders = mesh_slot(value).replicas
            if self.remove_redundancy:
                if self.save_to_minimum_rank:
                    owner = min(holders)
                else:
                    load = replica_load[holders]
                    owner = min(holders, key=load.__getitem__)  # the first of the least loaded
                    load[owner] += math.prod(chunk.sizes) * value.element_size()
                if owner != self.rank:
                    return None
            else:
                position = sorted(holders).index(self.rank)
                index = position or None
        return WriteItem(MetadataIndex(key, chunk.offsets, index), WriteItemType.TENSOR,
                         TensorWriteData(chunk, value.dtype, size))

    def build_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        return build_global_save_plan(all_plans, check_coverage=self.global_view)

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
