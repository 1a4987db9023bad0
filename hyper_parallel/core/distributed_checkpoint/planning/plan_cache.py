"""Save planning across ranks, reusing the last save's plans when nothing changed.

A training job saves the same structure again and again. Every rank keeps its last local
and final plan; the coordinator also keeps everybody's, plus the global plans and metadata.
A rank whose local plan is unchanged sends only its value checksums (:class:`_Unchanged`);
when all are unchanged the coordinator skips global planning, and a rank whose final plan
is unchanged gets only this save's id and storage data (:class:`_SameFinal`).
"""

from __future__ import annotations

import copy
import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Hashable, List, NamedTuple, Optional, Union

from hyper_parallel.core.distributed_checkpoint.format.metadata import Metadata
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, SavePlanner
from hyper_parallel.core.distributed_checkpoint.planning.collectives import DistWrapper
from hyper_parallel.core.distributed_checkpoint.planning.global_save_plan import check_values_agree
from hyper_parallel.core.distributed_checkpoint.storage import StorageWriter


class _Unchanged(NamedTuple):
    """A rank's local plan equals its cached one; only its value checksums travel."""

    value_checksums: Dict[str, int]


class _SameFinal(NamedTuple):
    """The coordinator's reply to a rank whose final plan is unchanged: only what is new
    in this save travels."""

    save_id: str
    storage_data: Any


@dataclass
class _Entry:
    """The plans of the last successful save for one cache key."""

    local: Optional[SavePlan] = None
    final: Optional[SavePlan] = None
    all_local: List[SavePlan] = field(default_factory=list)  # coordinator only, as below
    global_plans: List[SavePlan] = field(default_factory=list)
    metadata: Optional[Metadata] = None
    sent: List[SavePlan] = field(default_factory=list)


class PlannedSave(NamedTuple):
    """One rank's result of planning a save."""

    plan: SavePlan  # this rank's final plan (``save_id`` set)
    metadata: Optional[Metadata]  # the global metadata on the coordinator, None elsewhere
    key: Hashable
    entry: Optional[_Entry]  # what :meth:`SavePlanCache.remember` stores (None: not cached)


class SavePlanCache:
    """Plans collective saves (``gather_then_scatter``) and caches them per key (planner and
    writer types, rank, world size, options). Only successful saves are remembered."""

    def __init__(self) -> None:
        self._entries: Dict[Hashable, _Entry] = {}

    def plan(self, key: Hashable, dw: DistWrapper, planner: SavePlanner, writer: StorageWriter,
             build_local_plan: Callable[[], SavePlan]) -> PlannedSave:
        """Run save planning on every rank; returns this rank's plan and, on the coordinator,
        the metadata (with this save's id)."""
        cache = self._entries.get(key, _Entry())
        update = _Entry()

        def local_step() -> Union[SavePlan, _Unchanged]:
            update.local = build_local_plan()
            return _Unchanged(update.local.value_checksums) if update.local == cache.local else update.local

        def global_step(gathered: List[Union[SavePlan, _Unchanged]]) -> List[Union[SavePlan, _SameFinal]]:
            check_values_agree([g.value_checksums for g in gathered])
            if all(isinstance(g, _Unchanged) for g in gathered) and cache.global_plans:
                update.all_local, update.global_plans = cache.all_local, cache.global_plans
                update.metadata = cache.metadata
            else:
                update.all_local = [cache.all_local[r] if isinstance(g, _Unchanged) else g
                                    for r, g in enumerate(gathered)]
                update.global_plans, update.metadata = planner.build_global_plan(update.all_local)
            save_id = uuid.uuid4().hex
            update.sent = writer.optimize_global_plan(
                [dataclasses.replace(p, save_id=save_id) for p in update.global_plans])
            return [_SameFinal(p.save_id, p.storage_data)
                    if isinstance(gathered[r], _Unchanged) and r < len(cache.sent) and cache.sent[r] == p else p
                    for r, p in enumerate(update.sent)]

        reply = dw.gather_then_scatter("save planning", local_step, global_step)
        if isinstance(reply, _SameFinal):
            reply = dataclasses.replace(cache.final, save_id=reply.save_id, storage_data=reply.storage_data)
        update.final = reply
        metadata = None
        if dw.is_coordinator:
            metadata = copy.deepcopy(update.metadata)
            metadata.save_id = reply.save_id
        return PlannedSave(reply, metadata, key, update)

    def remember(self, planned: PlannedSave) -> None:
        """Keep ``planned``'s plans for the next save with its key."""
        self._entries[planned.key] = planned.entry

    def forget(self, key: Hashable) -> None:
        """Drop the plans of ``key`` (after a failed save)."""
        self._entries.pop(key, None)

    def clear(self) -> None:
        """Drop every cached plan."""
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
