"""``save``, ``async_save`` and ``load``: the planner/storage steps run in order across ranks."""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import os
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from hyper_parallel.core.distributed_checkpoint.collectives import DistWrapper
from hyper_parallel.core.distributed_checkpoint.filesystem import (
    FileSystemReader,
    FileSystemWriter,
    read_checkpoint_metadata,
)
from hyper_parallel.core.distributed_checkpoint.metadata import CheckpointError, Metadata
from hyper_parallel.core.distributed_checkpoint.planner import (
    LoadPlanner,
    SavePlan,
    SavePlanner,
    StandardLoadPlanner,
    StandardSavePlanner,
    check_values_agree,
)
from hyper_parallel.core.distributed_checkpoint.staging import StagingBuffers
from hyper_parallel.core.distributed_checkpoint.storage import StorageReader, StorageWriter

__all__ = ["save", "async_save", "load"]


def _dist_ready(no_dist: bool) -> bool:
    return not no_dist and dist.is_available() and dist.is_initialized()


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _resolve_stateful(state_dict: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``state_dict`` with its top-level Stateful values (``state_dict()``/``load_state_dict()``,
    e.g. ModelState, OptimizerState, modules) replaced by their ``state_dict()``, and those
    Stateful objects by key."""
    stateful = {key: value for key, value in state_dict.items() if _is_stateful(value)}
    if not stateful:
        return state_dict, {}
    return {key: value.state_dict() if key in stateful else value for key, value in state_dict.items()}, stateful


# ------------------------------------------------------------------------ save plan caching

@dataclass
class _PlanCache:
    """Last successful save's plans for one (planner, writer, options) combination.

    Every rank keeps its own local and final plan; the coordinator also keeps everybody's,
    plus the global plans and metadata. A rank whose local plan is unchanged sends only its
    value checksums; when all are unchanged the coordinator skips global planning and sends
    each rank only the per-save storage data (staging directory, save id).
    """

    local: Optional[SavePlan] = None
    final: Optional[SavePlan] = None
    all_local: List[SavePlan] = field(default_factory=list)
    global_plans: List[SavePlan] = field(default_factory=list)
    metadata: Optional[Metadata] = None
    sent: List[SavePlan] = field(default_factory=list)


_PLAN_CACHES: Dict[Tuple, _PlanCache] = {}


@dataclass
class _SaveContext:
    writer: StorageWriter
    planner: SavePlanner
    dw: DistWrapper
    plan: SavePlan
    metadata: Optional[Metadata]  # global (coordinator) or rank-local metadata; None elsewhere
    rank_local: bool
    cache_key: Tuple
    cache_update: _PlanCache


def _plan_save(state_dict: Dict[str, Any], checkpoint_id, storage_writer, planner, no_dist: bool,
               use_collectives: bool, remove_redundancy: bool, save_to_minimum_rank: bool) -> _SaveContext:
    writer = storage_writer if storage_writer is not None else FileSystemWriter()
    planner = planner if planner is not None else StandardSavePlanner()
    with_dist = _dist_ready(no_dist)
    rank = dist.get_rank() if with_dist else 0
    world = dist.get_world_size() if with_dist else 1
    rank_local = not use_collectives
    dw = DistWrapper(with_dist and not rank_local)
    key = (type(planner), type(writer), rank, world, rank_local, remove_redundancy, save_to_minimum_rank)

    def build_local_plan() -> SavePlan:
        writer.initialize_writer(None if checkpoint_id is None else os.fspath(checkpoint_id))
        planner.configure_planner(state_dict, rank=rank, is_coordinator=rank == 0,
                                  remove_redundancy=remove_redundancy, save_to_minimum_rank=save_to_minimum_rank,
                                  allow_pickle=getattr(writer, "allow_pickle", False), use_collectives=not rank_local)
        writer.configure_writer(rank == 0, rank=rank, world_size=world, use_collectives=not rank_local)
        return writer.optimize_local_plan(planner.build_local_plan())

    if rank_local:
        (plan,), metadata = planner.build_global_plan([build_local_plan()])
        metadata.world_size, metadata.save_id = world, uuid.uuid4().hex
        return _SaveContext(writer, planner, dw, planner.finalize_plan(plan), metadata, True, key, _PlanCache())

    cache = _PLAN_CACHES.get(key, _PlanCache())
    update = _PlanCache()

    def local_step():
        local = build_local_plan()
        update.local = local
        return ("same", local.value_checksums) if local == cache.local else ("plan", local)

    def global_step(gathered):
        check_values_agree([payload.value_checksums if kind == "plan" else payload for kind, payload in gathered])
        if all(kind == "same" for kind, _ in gathered) and cache.global_plans:
            update.all_local, update.global_plans = cache.all_local, cache.global_plans
            update.metadata = cache.metadata
        else:
            update.all_local = [p if kind == "plan" else cache.all_local[r] for r, (kind, p) in enumerate(gathered)]
            update.global_plans, update.metadata = planner.build_global_plan(update.all_local)
        final = writer.optimize_global_plan([dataclasses.replace(p) for p in update.global_plans])
        update.sent = final
        return [("same", p.storage_data)
                if gathered[r][0] == "same" and r < len(cache.sent) and cache.sent[r] == p else ("plan", p)
                for r, p in enumerate(final)]

    kind, payload = dw.gather_then_scatter("save planning", local_step, global_step)
    plan = dataclasses.replace(cache.final, storage_data=payload) if kind == "same" else payload
    update.final = plan
    metadata = copy.deepcopy(update.metadata) if dw.is_coordinator else None
    if metadata is not None:
        metadata.save_id = plan.storage_data["save_id"] if isinstance(plan.storage_data, dict) else uuid.uuid4().hex
    return _SaveContext(writer, planner, dw, planner.finalize_plan(plan), metadata, False, key, update)


def _remember_plans(ctx: _SaveContext) -> None:
    if not ctx.rank_local:
        _PLAN_CACHES[ctx.cache_key] = ctx.cache_update


def _forget_plans(ctx: _SaveContext) -> None:
    _PLAN_CACHES.pop(ctx.cache_key, None)


# -------------------------------------------------------------------------------- save

_pending_lock = threading.Lock()
_pending: Optional[concurrent.futures.Future] = None
_executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
_staging = StagingBuffers()


def wait_for_pending_save() -> None:
    """Block until this process's last ``async_save`` has finished (errors are left to its Future)."""
    with _pending_lock:
        pending = _pending
    if pending is not None:
        concurrent.futures.wait([pending])


def save(state_dict: Dict[str, Any], *, checkpoint_id: Optional[str] = None,
         storage_writer: Optional[StorageWriter] = None, planner: Optional[SavePlanner] = None,
         no_dist: bool = False, use_collectives: bool = True, remove_redundancy: bool = True,
         save_to_minimum_rank: bool = False) -> Metadata:
    """Save a (nested) state dict of DTensors, tensors and plain values as one checkpoint.
    Top-level Stateful values (objects with ``state_dict()``/``load_state_dict()``, e.g.
    ``ModelState``/``OptimizerState``) are saved as their ``state_dict()``.

    Call on every rank with the same structure. Each rank writes its own chunks; replicated
    DTensor chunks are written once (spread over their holders, or on the lowest rank with
    ``save_to_minimum_rank``; all copies with ``remove_redundancy=False``); a plain tensor or
    value is written once, by the lowest rank holding its key, and must be equal on every
    rank that holds it (per-rank data: rank-specific keys). The checkpoint is committed
    atomically (also when ``checkpoint_id`` already exists). Waits for a pending async save.

    Args:
        checkpoint_id: the checkpoint directory (or configure ``storage_writer`` with it).
        no_dist: save from this process alone, even if a process group exists.
        use_collectives: False: no communication; each rank commits its own rank-local
            metadata into ``checkpoint_id`` (which must not hold a checkpoint yet).

    Returns:
        The committed metadata (the rank's own with ``use_collectives=False``).

    Raises:
        CheckpointError: another rank failed, or values disagree between ranks.
        TypeError / ValueError: a value cannot be stored (names the key).
    """
    wait_for_pending_save()
    state_dict, _ = _resolve_stateful(state_dict)
    ctx = _plan_save(state_dict, checkpoint_id, storage_writer, planner, no_dist, use_collectives,
                     remove_redundancy, save_to_minimum_rank)
    if ctx.rank_local:
        ctx.writer.finalize_checkpoint(ctx.metadata, [ctx.writer.execute_write(ctx.plan, ctx.planner)])
        return ctx.metadata

    def commit(results):
        ctx.writer.finalize_checkpoint(ctx.metadata, results)
        return ctx.metadata

    try:
        metadata = ctx.dw.gather_then_broadcast(
            "save", lambda: ctx.writer.execute_write(ctx.plan, ctx.planner), commit)
    except BaseException:
        _forget_plans(ctx)
        abort = getattr(ctx.writer, "abort_checkpoint", None)
        if ctx.dw.is_coordinator and abort is not None:
            abort(ctx.plan)
        raise
    _remember_plans(ctx)
    return metadata


def _write_in_background(ctx: _SaveContext, staged) -> Optional[Metadata]:
    writer = ctx.writer
    try:
        result = writer.execute_write(ctx.plan, staged)
        if ctx.rank_local:
            writer.finalize_checkpoint(ctx.metadata, [result])
            return ctx.metadata
        writer.publish_result(ctx.plan, result)
        if ctx.dw.is_coordinator:
            writer.finalize_checkpoint(ctx.metadata, writer.collect_results(ctx.plan))
            return ctx.metadata
        writer.wait_committed(ctx.plan)
        metadata = read_checkpoint_metadata(writer.path)
        if metadata.save_id != ctx.plan.storage_data["save_id"]:
            raise CheckpointError(f"async save to {writer.path} was replaced by another save before it committed")
        return metadata
    except BaseException as exc:
        if not ctx.rank_local:
            writer.publish_failure(ctx.plan, exc)
        raise


def async_save(state_dict: Dict[str, Any], *, checkpoint_id: Optional[str] = None,
               storage_writer: Optional[StorageWriter] = None, planner: Optional[SavePlanner] = None,
               no_dist: bool = False, use_collectives: bool = True, remove_redundancy: bool = True,
               save_to_minimum_rank: bool = False) -> concurrent.futures.Future:
    """Like :func:`save`, but returns once the state is staged in CPU memory.

    Planning (the only collectives) runs in the caller; a background thread then writes
    the files, and the commit is coordinated through marker files in the staging directory
    (no collectives off the main thread). The Future resolves to the committed Metadata on
    every rank once the checkpoint is committed, or raises. What is saved is the state at
    the moment of the call. The next save or load in this process waits for this one.

    Raises (here): like :func:`save`'s planning; write errors are raised by the Future.
    """
    global _pending, _executor
    wait_for_pending_save()
    writer = storage_writer if storage_writer is not None else FileSystemWriter()
    commit_methods = ("publish_result", "publish_failure", "collect_results", "wait_committed")
    if use_collectives and not all(hasattr(writer, m) for m in commit_methods):
        raise TypeError(f"{type(writer).__name__} cannot commit asynchronously: it lacks {commit_methods}")
    state_dict, _ = _resolve_stateful(state_dict)
    ctx = _plan_save(state_dict, checkpoint_id, writer, planner, no_dist, use_collectives,
                     remove_redundancy, save_to_minimum_rank)
    staged = _staging.stage(ctx.plan, ctx.planner)
    _remember_plans(ctx)
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hyper_parallel-async-save")
    future = _executor.submit(_write_in_background, ctx, staged)
    with _pending_lock:
        _pending = future
    return future


def staging_buffers() -> StagingBuffers:
    """The process's async-save staging buffers (``nbytes``, ``allocations``), for monitoring."""
    return _staging


# -------------------------------------------------------------------------------- load

def _broadcast_replicas(planner: LoadPlanner) -> None:
    for tensor, src, group in planner.broadcasts():
        buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
        dist.broadcast(buffer, src=src, group=group)
        if buffer is not tensor:
            with torch.no_grad():
                tensor.copy_(buffer)


def load(state_dict: Dict[str, Any], *, checkpoint_id: Optional[str] = None,
         storage_reader: Optional[StorageReader] = None, planner: Optional[LoadPlanner] = None,
         no_dist: bool = False, use_collectives: bool = True, verify: bool = False) -> None:
    """Load a checkpoint into ``state_dict`` in place, resharding into its layout.

    Tensors (DTensor shards or plain) are filled in place from whatever chunks overlap them;
    non-tensor values are replaced. A top-level Stateful value has its ``state_dict()`` filled
    and then gets ``load_state_dict()`` of it. Each rank reads only the byte ranges it needs; a
    replicated shard is read once per replica group and broadcast (``use_collectives``).

    Args:
        checkpoint_id: the checkpoint directory (or configure ``storage_reader`` with it).
        no_dist: load in this process alone.
        use_collectives: False: no communication; each rank reads what it needs itself.
        verify: check every chunk read against its checksum.

    Raises:
        CheckpointError: not a committed checkpoint, corrupt or missing data (names the file),
            or a key missing / of another shape or dtype (names the key; see
            ``StandardLoadPlanner(strict=False)`` to record these instead).
    """
    wait_for_pending_save()
    caller_state_dict = state_dict
    state_dict, stateful = _resolve_stateful(state_dict)
    reader = storage_reader if storage_reader is not None else FileSystemReader()
    reader.initialize_reader(None if checkpoint_id is None else os.fspath(checkpoint_id))
    planner = planner if planner is not None else StandardLoadPlanner()
    with_dist = _dist_ready(no_dist)
    rank = dist.get_rank() if with_dist else 0
    dw = DistWrapper(with_dist and use_collectives)
    metadata = dw.from_coordinator("reading checkpoint metadata", reader.load_metadata)

    def local_step():
        planner.configure_planner(state_dict, metadata, rank=rank, is_coordinator=rank == 0,
                                  use_collectives=dw.use_dist)
        reader.configure_reader(metadata, rank == 0, verify=verify)
        return reader.optimize_local_plan(planner.build_local_plan())

    def global_step(plans):
        return reader.optimize_global_plan(planner.build_global_plan(plans))

    plan = dw.gather_then_scatter("load planning", local_step, global_step)
    plan = planner.finalize_plan(plan)
    dw.gather_then_broadcast("load", lambda: reader.execute_read(plan, planner), lambda _: None)
    if dw.use_dist:
        _broadcast_replicas(planner)
    if stateful:
        for key, value in state_dict.items():
            if key in stateful:
                stateful[key].load_state_dict(value)
            else:
                caller_state_dict[key] = value  # plain values were replaced in the resolved copy
