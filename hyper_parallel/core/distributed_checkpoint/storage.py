"""Storage interfaces: where a save's bytes go and where a load's bytes come from
(:class:`StorageWriter`, :class:`AsyncCommitWriter`, :class:`StorageReader`),
:class:`ChunkSource`, where a writer gets the tensor bytes it writes, and
:class:`CheckpointStore`, a backend that keeps checkpoints (a file system, an object store):
its writer and reader, its commit check, and a folder of ``step-N`` checkpoints."""

from __future__ import annotations

import abc
import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Union

import torch

from hyper_parallel.core.distributed_checkpoint.format.metadata import FileInfo, Metadata, MetadataIndex, StorageInfo
from hyper_parallel.core.distributed_checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItem


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
    -> (coordinator) ``finalize_checkpoint``; after a failed collective save the coordinator
    calls ``abort_checkpoint`` instead."""

    allow_pickle: bool = False
    """Whether values JSON cannot hold may be pickled (the planner is told before planning)."""

    @abc.abstractmethod
    def initialize_writer(self, checkpoint_id: Optional[str]) -> None:
        """Start a save to ``checkpoint_id`` (None: the location the writer was built with).
        Called first, on every rank, for every save (a writer may be reused).

        Raises:
            ValueError: no location, or one this writer cannot write (e.g. a URL for a path writer).
        """

    @abc.abstractmethod
    def configure_writer(self, is_coordinator: bool, **kwargs: Any) -> None:
        """Learn this rank's part: ``is_coordinator``, and the keyword arguments ``save``
        passes: ``rank``, ``world_size``, ``use_collectives``. Refuse what cannot be written
        here (e.g. a save without collectives where it cannot be committed)."""

    def optimize_local_plan(self, plan: SavePlan) -> SavePlan:
        """This rank's plan before it goes to the coordinator: the writer may annotate it
        (``storage_data``). Unchanged by default."""
        return plan

    def optimize_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        """Coordinator only, once per save (``plans[0].save_id`` set): prepare the save's
        storage (e.g. create its pending directory) and annotate the plans. Unchanged by default."""
        return plans

    @abc.abstractmethod
    def execute_write(self, plan: SavePlan, planner: SavePlanner) -> RankWriteResult:
        """Write this rank's items of ``plan``: tensor bytes from ``planner`` when it is a
        :class:`ChunkSource` (a save's snapshot), else from ``planner.get_data``; values from
        ``get_data``. Nothing is visible as a checkpoint yet. Returns where every item landed
        and each file's size and crc32."""

    @abc.abstractmethod
    def finalize_checkpoint(self, metadata: Metadata, results: List[RankWriteResult]) -> None:
        """Record ``results`` in ``metadata`` and commit the checkpoint (coordinator only)."""

    def abort_checkpoint(self, plan: SavePlan) -> None:
        """Coordinator, after a failed collective save (every rank has stopped writing):
        clean up what the save left. Nothing by default."""


class AsyncCommitWriter(StorageWriter):
    """A writer that can commit a collective save without collectives, from a background
    thread (what :func:`async_save` needs). After ``execute_write`` every rank calls
    ``publish_result`` (or ``publish_failure``); the coordinator then calls
    ``collect_results`` and ``finalize_checkpoint``, the others ``wait_committed``."""

    @abc.abstractmethod
    def publish_result(self, plan: SavePlan, result: RankWriteResult) -> None:
        """Make this rank's write results visible to the coordinator."""

    @abc.abstractmethod
    def publish_failure(self, plan: SavePlan, error: BaseException) -> None:
        """Tell the other ranks (best effort) that this rank's part failed."""

    @abc.abstractmethod
    def collect_results(self, plan: SavePlan) -> List[RankWriteResult]:
        """Coordinator: every rank's published results, in rank order (bounded wait)."""

    @abc.abstractmethod
    def wait_committed(self, plan: SavePlan) -> Metadata:
        """Non-coordinators: block until the coordinator committed this save (bounded wait);
        returns the committed metadata."""


class StorageReader(abc.ABC):
    """Reads one checkpoint. Order: ``initialize_reader`` -> ``load_metadata`` (coordinator) ->
    ``configure_reader`` -> ``optimize_local_plan`` -> ``optimize_global_plan`` -> ``execute_read``."""

    @abc.abstractmethod
    def initialize_reader(self, checkpoint_id: Optional[str]) -> None:
        """Start a load from ``checkpoint_id`` (None: the location the reader was built with).
        Called first, on every rank.

        Raises:
            ValueError: no location, or one this reader cannot read.
        """

    @abc.abstractmethod
    def load_metadata(self, **kwargs: Any) -> Metadata:
        """The checkpoint's committed metadata, checked (called on the coordinator, which sends
        it to every rank; works without a process group).

        Raises:
            CheckpointError: nothing committed there, or the metadata is corrupt.
        """

    @abc.abstractmethod
    def configure_reader(self, metadata: Metadata, is_coordinator: bool, **kwargs: Any) -> None:
        """Take the checkpoint's ``metadata`` and this rank's part (``is_coordinator``); keyword
        arguments ``load`` passes: ``verify`` (check chunks against their checksums)."""

    def optimize_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """This rank's plan before it goes to the coordinator: the reader may annotate it.
        Unchanged by default."""
        return plan

    def optimize_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        """Coordinator only: annotate every rank's plan (e.g. which rank checks which shared
        chunk). Unchanged by default."""
        return plans

    @abc.abstractmethod
    def execute_read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Read every item of ``plan`` into ``planner``'s destinations
        (``acquire_tensor`` / ``apply_tensor``, ``apply_bytes``), checking what the plan says
        this rank checks; returns once every item is applied and the caller's stream is
        ordered after any device copy.

        Raises:
            CheckpointError: a missing or truncated file, a checksum mismatch (names the file).
        """


class ChunkSource(abc.ABC):
    """Where a writer gets the bytes of the tensor chunks it writes."""

    @abc.abstractmethod
    def chunks(self, item: WriteItem) -> Iterator[torch.Tensor]:
        """The bytes of TENSOR ``item`` as consecutive host uint8 tensors, in order. Each is
        valid until the next one is requested (its memory is then reused)."""

    @abc.abstractmethod
    def known_checksum(self, item: WriteItem) -> Optional[int]:
        """crc32 of the item's bytes if already known, else None."""

    @abc.abstractmethod
    def abort(self, error: BaseException) -> None:
        """A writer failed: stop producing and wake every consumer with ``error``."""


class DirectChunks(ChunkSource):
    """A planner's chunks used directly (a writer called without staging): each chunk is
    fetched and moved to host memory when it is written."""

    def __init__(self, planner: SavePlanner) -> None:
        self._planner = planner

    def chunks(self, item: WriteItem) -> Iterator[torch.Tensor]:
        yield self._planner.get_data(item).detach().cpu().contiguous().reshape(-1).view(torch.uint8)

    def known_checksum(self, item: WriteItem) -> Optional[int]:
        return self._planner.known_checksum(item)

    def abort(self, error: BaseException) -> None:
        """Nothing runs ahead of the writer."""


# ------------------------------------------------------------------------------ stores

_STEP_NAME = re.compile(r"step-(\d+)")


def checkpoint_step(path: Union[str, os.PathLike]) -> Optional[int]:
    """The step encoded in a ``step-{N}`` checkpoint's name (the last component of a path or
    URL), or None."""
    match = _STEP_NAME.fullmatch(os.path.basename(os.path.normpath(os.fspath(path))))
    return int(match.group(1)) if match else None


class CheckpointStore(abc.ABC):
    """Where checkpoints are kept: one backend (a file system, an object store), chosen once
    from a checkpoint id by ``store_for``. A store at a location serves it as a checkpoint
    (its writer and reader, whether it is committed, its metadata, its verification) and as a
    :class:`~.manager.CheckpointManager` folder of ``step-N`` checkpoints (the steps, one job's
    lock, removal). How a save commits is the backend's own protocol, behind its writer."""

    location: str
    """The checkpoint or folder: a file system path, or a URL without a trailing slash."""

    lock_can_be_lost: bool = False
    """Whether a held folder lock can be lost to another job (a lease that stopped being
    renewed): then a save checks :meth:`lock_problem` first."""

    # --- one checkpoint -------------------------------------------------------------------

    @abc.abstractmethod
    def writer(self) -> AsyncCommitWriter:
        """A writer of a checkpoint at this location (``save``'s and ``async_save``'s default)."""

    @abc.abstractmethod
    def reader(self, *, verify: bool = True) -> StorageReader:
        """A reader of the checkpoint at this location (``load``'s default); ``verify``: check
        every chunk read against its checksum."""

    @abc.abstractmethod
    def is_checkpoint(self) -> bool:
        """True only when a committed checkpoint is here (what ``load`` accepts)."""

    @abc.abstractmethod
    def read_metadata(self) -> Metadata:
        """The committed metadata here, checked, without a process group.

        Raises:
            CheckpointError: nothing committed here, or the metadata is corrupt.
        """

    @abc.abstractmethod
    def verify(self, *, allow_pickle: bool = False) -> Metadata:
        """Every check ``load`` runs, without loading: the metadata, every data file's size and
        every item's and file's checksum (each byte read once), every value decodes (pickled
        ones only with ``allow_pickle``; never unpickled). Returns the metadata.

        Raises:
            CheckpointError: names what is uncommitted, inconsistent, missing, truncated or corrupt.
        """

    # --- a folder of step-N checkpoints ---------------------------------------------------

    @abc.abstractmethod
    def child(self, name: str) -> "CheckpointStore":
        """The store at ``name`` directly under this location."""

    @abc.abstractmethod
    def names(self) -> List[str]:
        """The names directly under this location (none when nothing is there)."""

    def step(self, step: int) -> "CheckpointStore":
        """The store of checkpoint ``step`` of this folder (``step-{N}``)."""
        return self.child(f"step-{step}")

    def committed_steps(self) -> List[int]:
        """Steps of the committed ``step-N`` checkpoints here, ascending (pending or partial
        ones ignored)."""
        steps = sorted(s for s in map(checkpoint_step, self.names()) if s is not None)
        return [s for s in steps if self.step(s).is_checkpoint()]

    @abc.abstractmethod
    def hold(self) -> Optional[str]:
        """Rank 0 of a manager, before any save of its own: take this folder for the job
        (create it, lock it: one job per folder) and remove what saves killed in it left.
        Returns None (held; or used unlocked, with a warning, where the lock cannot be made,
        e.g. read-only access), or a sentence saying why not (another job holds it)."""

    @abc.abstractmethod
    def release(self) -> None:
        """Give up what :meth:`hold` took (another job may then use the folder); once."""

    def lock_problem(self) -> Optional[str]:
        """Why this process no longer holds the folder (its lock was lost), or None."""
        return None

    def confirm_lock(self, doing: str) -> Optional[str]:
        """Why this process may not ``doing`` (e.g. delete old checkpoints) because it lost the
        folder's lock, asked of the backend now rather than from the last renewal; None: it
        may. Nothing to confirm by default (a lock that cannot be lost)."""
        return None

    def after_commit(self) -> None:
        """Rank 0, after a save of this job committed and while none is in flight: reclaim what
        failed saves left that their own cleanup could not. Nothing by default."""

    @abc.abstractmethod
    def remove(self) -> None:
        """Delete the checkpoint here (retention): it stops being a checkpoint first."""

    @abc.abstractmethod
    def write_problem(self, name: str) -> Optional[str]:
        """Before a job starts: a sentence saying why this location cannot be written, naming
        it ``{name}={location}`` (``name`` is what the caller calls it, e.g. a config key), or
        None when it can (a local folder is created if missing)."""
