"""CPU snapshots of the data a save writes, so an async save records the state at call time."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from hyper_parallel.core.distributed_checkpoint.metadata import MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from hyper_parallel.platform import get_platform


class StagedData:
    """Stands in for the planner while the background thread writes: ``get_data`` serves
    the snapshot."""

    def __init__(self, data: Dict[MetadataIndex, Any], checksums: Dict[MetadataIndex, int]) -> None:
        self._data, self._checksums = data, checksums

    def get_data(self, item) -> Any:
        return self._data[item.index]

    def known_checksum(self, item) -> Optional[int]:
        return self._checksums.get(item.index)


class StagingBuffers:
    """Reusable CPU buffers (pinned on accelerators) for one plan structure.

    Every tensor is copied, including those already on CPU, so that in-place changes after
    ``async_save`` returns cannot leak into the checkpoint. A plan with the same structure as
    the last one reuses its buffers, so repeated saves do not grow memory. Callers must make
    sure the previous write from these buffers has finished before staging again.
    """

    def __init__(self) -> None:
        self._signature: Tuple = ()
        self._buffers: List[torch.Tensor] = []
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def stage(self, plan: SavePlan, planner: SavePlanner) -> StagedData:
        platform = get_platform()
        tensors = [it for it in plan.items if it.type == WriteItemType.TENSOR]
        sources = [planner.get_data(it) for it in tensors]
        signature = tuple((it.index, tuple(t.shape), t.dtype) for it, t in zip(tensors, sources))
        if signature != self._signature:
            self._buffers = []  # drop the old set before allocating the new one
            self._buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=platform.pin_memory_available())
                             for t in sources]
            self._signature = signature
            self.allocations += 1
        for buffer, source in zip(self._buffers, sources):
            buffer.copy_(source.detach(), non_blocking=True)
        platform.synchronize()
        data: Dict[MetadataIndex, Any] = {it.index: buf for it, buf in zip(tensors, self._buffers)}
        for it in plan.items:
            if it.type == WriteItemType.BYTE_IO:
                data[it.index] = planner.get_data(it)  # bytes serialised at plan time: a snapshot
        # Planning checksummed these bytes moments ago (same thread, before the copy).
        known = getattr(planner, "known_checksum", None)
        checksums = {} if known is None else {it.index: known(it) for it in tensors}
        return StagedData(data, {index: crc for index, crc in checksums.items() if crc is not None})
