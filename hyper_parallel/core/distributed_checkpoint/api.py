"""``save``, ``async_save`` and ``load``: the planner/storage steps run in order across ranks."""

from __future__ import annotations

import functools
import os
import uuid
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar

import torch
import torch.distributed as dist

from hyper_parallel.core.distributed_checkpoint.dcp_interop.reader import DcpReader, is_dcp_checkpoint
from hyper_parallel.core.distributed_checkpoint.format.metadata import Metadata
from hyper_parallel.core.distributed_checkpoint.host_memory.background import AsyncSaveFuture, AsyncSaver, optimizers_in
from hyper_parallel.core.distributed_checkpoint.host_memory.staging_buffers import StagingBuffers
from hyper_parallel.core.distributed_checkpoint.host_memory.snapshot import StagedSave
from hyper_parallel.core.distributed_checkpoint.object_store.store import unreachable_named
from hyper_parallel.core.distributed_checkpoint.planner import LoadPlanner, SavePlan, SavePlanner
from hyper_parallel.core.distributed_checkpoint.planning.collectives import DistWrapper
from hyper_parallel.core.distributed_checkpoint.planning.load_planner import StandardLoadPlanner
from hyper_parallel.core.distributed_checkpoint.planning.plan_cache import PlannedSave, SavePlanCache
from hyper_parallel.core.distributed_checkpoint.planning.save_planner import StandardSavePlanner
from hyper_parallel.core.distributed_checkpoint.stateful import resolve_stateful
from hyper_parallel.core.distributed_checkpoint.stores import store_for
from hyper_parallel.core.distributed_checkpoint.storage import (
    AsyncCommitWriter,
    RankWriteResult,
    StorageReader,
    StorageWriter,
)
from hyper_parallel.platform import get_platform
from hyper_parallel.utils.ranks import dist_ready, rank_and_world

__all__ = ["save", "async_save", "load", "is_checkpoint", "read_checkpoint_metadata", "verify_checkpoint"]

_PLANS = SavePlanCache()
_SAVER = AsyncSaver()


def _dist_ready(no_dist: bool) -> bool:
    return not no_dist and dist_ready()


def _default_writer(checkpoint_id: Optional[str]) -> AsyncCommitWriter:
    """The writer of ``checkpoint_id``'s store (``store_for``)."""
    if checkpoint_id is None:
        raise ValueError("no checkpoint path: pass checkpoint_id or FileSystemWriter(path)")
    return store_for(checkpoint_id).writer()


def _default_reader(checkpoint_id: Optional[str]) -> StorageReader:
    """The reader of ``checkpoint_id``'s store (``store_for``); a torch DCP directory
    (``.metadata``, none of ours) is read as it is."""
    if checkpoint_id is None:
        raise ValueError("no checkpoint path: pass checkpoint_id or FileSystemReader(path)")
    return DcpReader() if is_dcp_checkpoint(checkpoint_id) else store_for(checkpoint_id).reader()


class _SaveJob:
    """What one save call works with: its state (:class:`Stateful` values resolved), writer,
    planner, rank, process group and plan cache key."""

    def __init__(self, state_dict: Dict[str, Any], checkpoint_id: Optional[str],
                 writer: Optional[StorageWriter], planner: Optional[SavePlanner], no_dist: bool,
                 use_collectives: bool, remove_redundancy: bool, save_to_minimum_rank: bool) -> None:
        self.state_dict, self.stateful = resolve_stateful(state_dict)
        self.checkpoint_id = None if checkpoint_id is None else os.fspath(checkpoint_id)
        self.writer = writer if writer is not None else _default_writer(self.checkpoint_id)
        self.planner = planner if planner is not None else StandardSavePlanner()
        with_dist = _dist_ready(no_dist)
        self.rank, self.world = rank_and_world(with_dist)
        self.use_collectives = use_collectives
        self.remove_redundancy, self.save_to_minimum_rank = remove_redundancy, save_to_minimum_rank
        self.dw = DistWrapper(with_dist and use_collectives)
        self.key = (type(self.planner), type(self.writer), self.rank, self.world, use_collectives,
                    remove_redundancy, save_to_minimum_rank)

    def build_local_plan(self) -> SavePlan:
        self.writer.initialize_writer(self.checkpoint_id)
        self.planner.configure_planner(
            self.state_dict, rank=self.rank, is_coordinator=self.rank == 0,
            remove_redundancy=self.remove_redundancy, save_to_minimum_rank=self.save_to_minimum_rank,
            allow_pickle=self.writer.allow_pickle, use_collectives=self.use_collectives)
        self.writer.configure_writer(self.rank == 0, rank=self.rank, world_size=self.world,
                                     use_collectives=self.use_collectives)
        return self.writer.optimize_local_plan(self.planner.build_local_plan())

    def plan(self) -> PlannedSave:
        """Collective planning (cached in ``_PLANS``), or this rank's alone without collectives."""
        if self.use_collectives:
            planned = _PLANS.plan(self.key, self.dw, self.planner, self.writer, self.build_local_plan)
        else:
            (plan,), metadata = self.planner.build_global_plan([self.build_local_plan()])
            plan.save_id = metadata.save_id = uuid.uuid4().hex
            metadata.world_size = self.world
            planned = PlannedSave(plan, metadata, self.key, None)
        return planned._replace(plan=self.planner.finalize_plan(planned.plan))

    def plan_and_stage(self, snapshot: bool) -> Tuple[PlannedSave, StagedSave]:
        """The plan, and its copy to host memory (all of it: ``snapshot``, for async saves)."""
        planned = self.plan()
        return planned, StagedSave(_SAVER.staging, planned.plan, self.planner, snapshot=snapshot)


_Call = TypeVar("_Call", bound=Callable[..., Any])


def _store_named_when_unreachable(call: _Call) -> _Call:
    """``call`` (which takes ``checkpoint_id=``), raising a store that does not answer as a
    ``CheckpointError`` naming its endpoint (the store's own request bounds end the wait)."""
    @functools.wraps(call)
    def named(*args: Any, **kwargs: Any) -> Any:
        checkpoint_id = kwargs.get("checkpoint_id", args[0] if args and isinstance(args[0], (str, os.PathLike))
                                   else None)
        with unreachable_named(None if checkpoint_id is None else os.fspath(checkpoint_id)):
            return call(*args, **kwargs)
    return named  # type: ignore[return-value]


# -------------------------------------------------------------------------------- save

def wait_for_pending_save() -> None:
    """Block until this process's last ``async_save`` has finished (errors are left to its Future)."""
    _SAVER.wait()


@_store_named_when_unreachable
def save(state_dict: Dict[str, Any], *, checkpoint_id: Optional[str] = None,
         storage_writer: Optional[StorageWriter] = None, planner: Optional[SavePlanner] = None,
         no_dist: bool = False, use_collectives: bool = True, remove_redundancy: bool = True,
         save_to_minimum_rank: bool = False) -> Metadata:
    """Save a (nested) state dict of DTensors, tensors and plain values as one checkpoint.
    Top-level :class:`Stateful` values (``state_dict()``/``load_state_dict()``, e.g.
    ``ModelState``/``OptimizerState``) are saved as their ``state_dict()``.

    Call on every rank with the same structure. Each rank writes its own chunks; replicated
    DTensor chunks are written once (spread over their holders, or on the lowest rank with
    ``save_to_minimum_rank``; all copies with ``remove_redundancy=False``); a plain tensor or
    value is written once, by the lowest rank holding its key, and must be equal on every
    rank that holds it (per-rank data: rank-specific keys). The checkpoint is committed
    atomically (also when ``checkpoint_id`` already exists). Waits for a pending async save.

    Args:
        checkpoint_id: the checkpoint directory, or an fsspec URL (``s3://bucket/run/step-100``,
            ``memory://...``; written by :class:`FsspecWriter`); or configure ``storage_writer``.
        no_dist: save from this process alone, even if a process group exists.
        use_collectives: False: no communication; each rank commits its own rank-local
            metadata into ``checkpoint_id`` (which must not hold a checkpoint yet).

    Returns:
        The committed metadata (the rank's own with ``use_collectives=False``).

    Raises:
        CheckpointError: another rank failed, or values disagree between ranks.
        TypeError / ValueError: a value cannot be stored (names the key).
    """
    _SAVER.wait()
    job = _SaveJob(state_dict, checkpoint_id, storage_writer, planner, no_dist, use_collectives,
                   remove_redundancy, save_to_minimum_rank)
    planned, staged = job.plan_and_stage(snapshot=False)

    def write() -> RankWriteResult:  # the async save's copy stages, waited on
        return _SAVER.write_while_staging(lambda: staged.write_with(job.writer, planned.plan), staged).result()

    if not use_collectives:
        return _write_rank_local(job.writer, planned, write)

    def commit(results):
        job.writer.finalize_checkpoint(planned.metadata, results)
        return planned.metadata

    try:
        metadata = job.dw.gather_then_broadcast("save", write, commit)
    except BaseException:
        _PLANS.forget(job.key)
        if job.dw.is_coordinator:
            job.writer.abort_checkpoint(planned.plan)
        raise
    _PLANS.remember(planned)
    return metadata


def _write_rank_local(writer: StorageWriter, planned: PlannedSave,
                      write: Callable[[], RankWriteResult]) -> Metadata:
    """A save without collectives: ``write`` this rank's files, then commit its own metadata."""
    writer.finalize_checkpoint(planned.metadata, [write()])
    return planned.metadata


def _write_then_commit(writer: AsyncCommitWriter, planned: PlannedSave, staged: StagedSave,
                       is_coordinator: bool) -> Metadata:
    """Background thread of a collective async save: write, then commit through the writer's
    marker protocol (no collectives off the main thread)."""
    try:
        writer.publish_result(planned.plan, staged.write_with(writer, planned.plan))
        if is_coordinator:
            writer.finalize_checkpoint(planned.metadata, writer.collect_results(planned.plan))
            return planned.metadata
        return writer.wait_committed(planned.plan)
    except BaseException as exc:
        writer.publish_failure(planned.plan, exc)
        if is_coordinator:
            writer.abort_checkpoint(planned.plan)  # a failed save must not keep its files (disk full)
        raise


def async_save(state_dict: Dict[str, Any], *, checkpoint_id: Optional[str] = None,
               storage_writer: Optional[StorageWriter] = None, planner: Optional[SavePlanner] = None,
               no_dist: bool = False, use_collectives: bool = True, remove_redundancy: bool = True,
               save_to_minimum_rank: bool = False, stage_in_background: bool = False) -> AsyncSaveFuture:
    """Like :func:`save`, but returns once the state is staged in host memory, or, with
    ``stage_in_background``, right after planning.

    Planning (the only collectives) runs in the caller; the staging copy then runs in the
    caller (default) or on a staging thread, and a background thread writes the files; the
    commit is coordinated through marker files in the staging directory (no collectives off
    the main thread; the writer must be an :class:`AsyncCommitWriter`). What is saved is the
    state at the moment of the call. The next save or load in this process waits for this one.

    Args:
        stage_in_background: return before the state is staged (docs/checkpoint.md, "Async
            save"): ``optimizer.step()`` of the optimizers in ``state_dict`` (top-level
            ``torch.optim.Optimizer`` or ``OptimizerState``-like wrappers) then waits for
            staging through a step pre-hook installed here; any other in-place update of the
            saved tensors must call ``wait_for_staging()`` on the returned Future first.

    Returns:
        An :class:`AsyncSaveFuture`: resolves to the committed Metadata on every rank (or
        raises); ``wait_for_staging()`` / ``staging_completion`` for the staging copy.

    Raises (here): like :func:`save`'s planning, and staging errors unless staged in the
    background; write errors are raised by the Future.
    """
    _SAVER.wait()
    checkpoint_id = None if checkpoint_id is None else os.fspath(checkpoint_id)
    writer = storage_writer if storage_writer is not None else _default_writer(checkpoint_id)
    if use_collectives and not isinstance(writer, AsyncCommitWriter):
        raise TypeError(f"{type(writer).__name__} cannot commit asynchronously: it is not an AsyncCommitWriter")
    job = _SaveJob(state_dict, checkpoint_id, writer, planner, no_dist, use_collectives,
                   remove_redundancy, save_to_minimum_rank)
    planned, staged = job.plan_and_stage(snapshot=True)
    if use_collectives:
        _PLANS.remember(planned)

        def write() -> Metadata:
            return _write_then_commit(writer, planned, staged, job.dw.is_coordinator)
    else:
        def write() -> Metadata:
            return _write_rank_local(writer, planned, lambda: staged.write_with(writer, planned.plan))
    if stage_in_background:
        _SAVER.guard(optimizers_in(job.stateful))
    return _SAVER.start(write, staged, background=stage_in_background)


def staging_buffers() -> StagingBuffers:
    """The process's staging buffers: ``configure(...)`` their sizes, ``release()`` their
    memory, read ``nbytes`` / ``allocations`` (see docs/checkpoint.md)."""
    return _SAVER.staging


# -------------------------------------------------------------------------------- load

def _broadcast_replicas(planner: LoadPlanner) -> None:
    """Fill the replicas' shards from the rank of their group that read them
    (``planner.broadcasts()``). A shard the group's backends cannot move where it lives (host
    memory over NCCL / HCCL: CPU-offloaded parameters under HSDP or TP) is broadcast through
    a copy on this rank's device (``Platform.collective_device``)."""
    platform, rank = get_platform(), dist.get_rank()
    for tensor, src, group in planner.broadcasts():
        device = platform.collective_device(tensor.device, group)
        if device == tensor.device and tensor.is_contiguous():
            dist.broadcast(tensor, src=src, group=group)
            continue
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        if rank == src:
            buffer.copy_(tensor)
        dist.broadcast(buffer, src=src, group=group)
        if rank != src:
            with torch.no_grad():
                tensor.copy_(buffer)


@_store_named_when_unreachable
def load(state_dict: Dict[str, Any], *, checkpoint_id: Optional[str] = None,
         storage_reader: Optional[StorageReader] = None, planner: Optional[LoadPlanner] = None,
         no_dist: bool = False, use_collectives: bool = True, verify: bool = True) -> None:
    """Load a checkpoint into ``state_dict`` in place, resharding into its layout.

    Tensors (DTensor shards or plain) are filled in place from whatever chunks overlap them;
    non-tensor values are replaced. A top-level :class:`Stateful` value has its
    ``state_dict()`` filled and then gets ``load_state_dict()`` of it. Each rank reads only
    the byte ranges it needs; a replicated shard is read once per replica group and
    broadcast (``use_collectives``).

    Args:
        checkpoint_id: the checkpoint directory, or an fsspec URL (read by
            :class:`FsspecReader`); or configure ``storage_reader`` with it.
        no_dist: load in this process alone.
        use_collectives: False: no communication; each rank reads what it needs itself.
        verify: check every chunk read against its checksum (the default; False skips it,
            as does a reader built with ``verify=False``).

    Raises:
        CheckpointError: not a committed checkpoint, corrupt or missing data (names the file),
            or a key missing / of another shape or dtype (names the key; see
            ``StandardLoadPlanner(strict=False)`` to record these instead).

    A torch DCP checkpoint directory is read directly (``dcp_interop.DcpReader``; it has no
    checksums, so ``verify`` has nothing to check and says so once in the log).
    """
    _SAVER.wait()
    caller_state_dict = state_dict
    state_dict, stateful = resolve_stateful(state_dict)
    checkpoint_id = None if checkpoint_id is None else os.fspath(checkpoint_id)
    reader = storage_reader if storage_reader is not None else _default_reader(checkpoint_id)
    reader.initialize_reader(checkpoint_id)
    planner = planner if planner is not None else StandardLoadPlanner()
    with_dist = _dist_ready(no_dist)
    rank, _ = rank_and_world(with_dist)
    dw = DistWrapper(with_dist and use_collectives)
    metadata = dw.from_coordinator("reading checkpoint metadata", reader.load_metadata)

    def local_step():
        planner.configure_planner(state_dict, metadata, rank=rank, is_coordinator=rank == 0,
                                  use_collectives=dw.use_dist)
        reader.configure_reader(metadata, rank == 0, verify=verify)
        return reader.optimize_local_plan(planner.build_local_plan())

    def global_step(plans):
        return reader.optimize_global_plan(planner.build_global_plan(plans))

    plan = planner.finalize_plan(dw.gather_then_scatter("load planning", local_step, global_step))
    dw.gather_then_broadcast("load", lambda: reader.execute_read(plan, planner), lambda _: None)
    if dw.use_dist:
        _broadcast_replicas(planner)
    for key, value in stateful.items():
        value.load_state_dict(state_dict[key])
    if stateful:  # plain values were replaced in the resolved copy
        caller_state_dict.update((k, v) for k, v in state_dict.items() if k not in stateful)


# -------------------------------------------------------------------------------- checks

@_store_named_when_unreachable
def is_checkpoint(checkpoint_id: str) -> bool:
    """True only for a committed checkpoint: a directory with committed metadata, or an fsspec
    URL whose ``metadata.json`` object exists."""
    return store_for(checkpoint_id).is_checkpoint()


@_store_named_when_unreachable
def read_checkpoint_metadata(checkpoint_id: str) -> Metadata:
    """The committed metadata of a checkpoint (a directory or an fsspec URL), without a
    process group.

    Raises:
        CheckpointError: nothing committed there, or the metadata is corrupt.
    """
    return store_for(checkpoint_id).read_metadata()


@_store_named_when_unreachable
def verify_checkpoint(checkpoint_id: str, *, allow_pickle: bool = False) -> Metadata:
    """Run every check ``load`` runs, without loading: the metadata, every file's size and
    every item's and file's checksum (each byte read once), every value decodes.
    ``checkpoint_id``: a directory or an fsspec URL.

    Returns the metadata. Raises:
        CheckpointError: names what is uncommitted, inconsistent, missing, truncated or corrupt.
    """
    return store_for(checkpoint_id).verify(allow_pickle=allow_pickle)
