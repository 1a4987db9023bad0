"""CPU snapshots of the data a save writes, so an async save records the state at call time."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from hyper_parallel.core.distributed_checkpoint.metadata import Metadata, MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from hyper_parallel.platform import get_platform


class StagedData(SavePlanner):
    """The planner of a staged save: planning steps go to the original planner, ``get_data``
    serves the snapshot taken at staging time."""

    def __init__(self, planner: SavePlanner, data: Dict[MetadataIndex, Any],
                 checksums: Dict[MetadataIndex, int]) -> None:
        self._planner, self._data, self._checksums = planner, data, checksums

    def configure_planner(self, state_dict: Dict[str, Any], **kwargs: Any) -> None:
        self._planner.configure_planner(state_dict, **kwargs)

    def build_local_plan(self) -> SavePlan:
        return self._planner.build_local_plan()

    def build_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        return self._planner.build_global_plan(all_plans)

    def finalize_plan(self, plan: SavePlan) -> SavePlan:
        return self._planner.finalize_plan(plan)

    def get_data(self, item: WriteItem) -> Any:
        return self._data[item.index]

    def known_checksum(self, item: WriteItem) -> Optional[int]:
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
        checksums = {it.index: planner.known_checksum(it) for it in tensors}
        return StagedData(planner, data, {index: crc for index, crc in checksums.items() if crc is not None})
