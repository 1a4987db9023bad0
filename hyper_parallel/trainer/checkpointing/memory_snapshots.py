"""In-memory snapshots (``checkpoint.memory_interval``): every N steps each rank saves its whole
training state into node-local host memory (``checkpoint.memory_dir``, a tmpfs that outlives the
worker processes) and sends a copy to its partner rank, which keeps it as a replica.

A snapshot is a checkpoint in the durable format (safetensors files, checksums, rank-local
metadata), written by the same writer through the same staging buffers and background saver as an
async durable save (``hdcp.async_save(..., stage_in_background=True)``), so a restarted job reads
it with the same checks (``verify_checkpoint``, ``load``). Each rank keeps, in
``{memory_dir}/job-{id}/rank-{r}/``:

- ``step-N``: its own snapshot, written beside the previous one (``.writing-step-N``), renamed
  into place once committed; the previous one is deleted once every rank holds step N;
- ``replica-of-{s}-step-N``: the replica of its source rank ``s``'s snapshot (the rank whose
  partner it is), the folder's files byte for byte: received over a gloo group of the job's from
  another node, copied from the source's folder in the same ``memory_dir`` on one node; written
  beside the previous replica and switched once every rank holds its replica of step N.

So a rank holds at most its own snapshot and one replica plus the one being written, and at every
moment some step is held by every rank (own) and replicated (partner): the previous step until
the new one is everywhere.

Partner: the same local rank of the next node (``(rank + ranks_per_node) % world``), so a node
lost whole leaves its ranks' replicas on the next node. On one node (``world <= ranks_per_node``)
the partner is the next rank, which copies its source's folder (half the CPU time of a gloo
transfer over loopback): the replica then protects against a lost or damaged snapshot, not
against the loss of the machine.

Snapshots live in a folder of the job's identity (``job-{id}``: a hash of the absolute
``output_dir`` and the config, ``checkpoint.memory_dir`` aside), also written into each snapshot
(``snapshot.json``), so another job's snapshots are never loaded (recovery names them).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hyper_parallel.checkpoint import CheckpointError, FileSystemWriter, OptimizerState
from hyper_parallel.checkpoint import async_save
from hyper_parallel.trainer.config.memory import MemorySnapshotKeys
from hyper_parallel.trainer.config.schema import TrainConfig
from hyper_parallel.trainer.checkpointing.snapshot_transfer import all_ranks_agree, mapped_or_nothing, transfer

_log = logging.getLogger(__name__)

SNAPSHOT_INFO = "snapshot.json"  # the job identity, rank and step, in every snapshot folder
_OWN = re.compile(r"step-(\d+)")
_REPLICA = re.compile(r"replica-of-(\d+)-step-(\d+)")
_SCRATCH = ".writing-"  # a snapshot or replica being written (never read)


def partner_of(rank: int, world: int, ranks_per_node: int) -> Optional[int]:
    """The rank that keeps ``rank``'s replica: the same local rank of the next node, or on one
    node the next rank; None for a job of one rank."""
    if world < 2:
        return None
    step = ranks_per_node if world > ranks_per_node else 1
    return (rank + step) % world


def source_of(rank: int, world: int, ranks_per_node: int) -> Optional[int]:
    """The rank whose replica ``rank`` keeps (``partner_of``'s inverse)."""
    if world < 2:
        return None
    step = ranks_per_node if world > ranks_per_node else 1
    return (rank - step) % world


def job_identity(cfg: TrainConfig) -> Dict[str, str]:
    """What tells this job's snapshots from another's: the absolute ``output_dir`` and a hash of
    it with the whole config (``checkpoint.memory_dir`` aside: it may differ between nodes)."""
    values = dataclasses.asdict(cfg)
    values["checkpoint"].pop("memory_dir", None)
    values["output_dir"] = os.path.abspath(cfg.output_dir)
    digest = hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"job": digest, "output_dir": values["output_dir"]}


class SnapshotFolder:
    """Where one rank's snapshots are: ``{memory_dir}/job-{id}/rank-{rank}``."""

    def __init__(self, memory_dir: str, job: str, rank: int):
        self.memory_dir = os.path.abspath(memory_dir)
        self.root = os.path.join(self.memory_dir, f"job-{job}")
        self.path = os.path.join(self.root, f"rank-{rank}")

    def of_rank(self, rank: int) -> "SnapshotFolder":
        """The folder of another rank's snapshots in the same ``memory_dir``."""
        return SnapshotFolder(self.memory_dir, os.path.basename(self.root)[len("job-"):], rank)

    def ranks_here(self) -> List[int]:
        """The ranks with a folder in this node's ``memory_dir`` (for this job)."""
        names = os.listdir(self.root) if os.path.isdir(self.root) else []
        return sorted(int(m.group(1)) for name in names if (m := re.fullmatch(r"rank-(\d+)", name)))

    def own(self, step: int) -> str:
        return os.path.join(self.path, f"step-{step}")

    def replica(self, source: int, step: int) -> str:
        return os.path.join(self.path, f"replica-of-{source}-step-{step}")

    def scratch(self, name: str) -> str:
        """A fresh folder beside the snapshots to write ``name`` into (renamed into place)."""
        path = os.path.join(self.path, _SCRATCH + name)
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        return path

    def listing(self) -> Tuple[Dict[int, str], Dict[Tuple[int, int], str]]:
        """The snapshot folders here: own step -> path, and (source, step) -> path of replicas."""
        own: Dict[int, str] = {}
        replicas: Dict[Tuple[int, int], str] = {}
        names = os.listdir(self.path) if os.path.isdir(self.path) else []
        for name in names:
            if (m := _OWN.fullmatch(name)) is not None:
                own[int(m.group(1))] = os.path.join(self.path, name)
            elif (m := _REPLICA.fullmatch(name)) is not None:
                replicas[(int(m.group(1)), int(m.group(2)))] = os.path.join(self.path, name)
        return own, replicas

    def keep_only(self, keep: List[str]) -> None:
        """Delete every snapshot, replica and scratch folder here but ``keep``."""
        for name in os.listdir(self.path) if os.path.isdir(self.path) else []:
            path = os.path.join(self.path, name)
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)

    def remove(self) -> None:
        """Delete this rank's folder, and the job's when it is empty (the node's last rank)."""
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            os.rmdir(self.root)
        except OSError:
            pass  # another rank of this node still has its folder


def switch_into_place(scratch: str, final: str) -> None:
    """Make the written ``scratch`` folder the snapshot ``final`` (one rename: whole or absent)."""
    shutil.rmtree(final, ignore_errors=True)
    os.rename(scratch, final)


def _localize(value: Any) -> Any:
    """``value`` with every DTensor replaced by its local tensor (the same storage)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _localize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_localize(v) for v in value)
    return value


def _restore(template: Any, filled: Any) -> Any:
    """``filled`` (a loaded :func:`_localize` of ``template``) with ``template``'s DTensors back:
    their local tensors were filled in place."""
    if isinstance(template, DTensor):
        return template
    if isinstance(template, dict) and isinstance(filled, dict):
        return {k: _restore(template[k], v) if k in template else v for k, v in filled.items()}
    if isinstance(template, (list, tuple)) and isinstance(filled, (list, tuple)) and len(template) == len(filled):
        return type(filled)(_restore(t, v) for t, v in zip(template, filled))
    return filled


class LocalShards:
    """A Stateful view of ``inner`` (``state_dict()`` / ``load_state_dict()``) in which every
    DTensor is this rank's local shard: a snapshot restores the rank that wrote it, on the same
    mesh, so it stores local tensors, which the checkpoint format checks as whole tensors. An
    optimizer's view exposes it as ``optim``, so a background-staged save guards its step."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.optim = inner.optim if isinstance(inner, OptimizerState) else None
        self._template: Any = None

    def state_dict(self) -> Dict[str, Any]:
        self._template = self.inner.state_dict()
        return _localize(self._template)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.inner.load_state_dict(_restore(self._template, state))


def local_shards(state: Dict[str, Any]) -> Dict[str, LocalShards]:
    """``state``'s Stateful values as :class:`LocalShards`."""
    return {key: LocalShards(value) for key, value in state.items()}


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def local_state_bytes(state: Dict[str, Any]) -> int:
    """Bytes of this rank's tensors in a snapshot of ``state``: its model shards, and its AdamW
    moments (two per parameter shard, before the first step creates them)."""
    params = sum(_local_bytes(t) for t in state["model"].state_dict().values() if isinstance(t, torch.Tensor))
    optim = state["optim"].optim
    if optim.state:
        return params + sum(_local_bytes(v) for per_param in optim.state.values() for v in per_param.values()
                            if isinstance(v, torch.Tensor))
    return params + 2 * sum(_local_bytes(p) for group in optim.param_groups for p in group["params"])


# ---------------------------------------------------------------------- taking snapshots

class MemorySnapshots:
    """This rank's snapshots: :meth:`take` one every ``interval`` steps; recovery (recovery.py)
    reads them; :meth:`remove` them when the job has finished.

    All ranks call :meth:`take` at the same steps. The rank's state is staged and written in the
    background (hdcp's async saver); a thread of this object then switches the snapshot into place
    and replicates it over ``group`` (a gloo group of all ranks, used by this thread only), with
    one all-reduce after each part so that the previous step is deleted only once every rank
    holds the new one. A failed part is logged (training goes on; the previous step stays).

    The training step never waits for a snapshot's write or replica: a snapshot due while the
    previous one is still in flight on some rank (:meth:`in_flight`, which the ranks vote on with
    their step's other votes) is deferred to the next step, so one snapshot at most is in flight.

    Args:
        folder: where this rank's snapshots are.
        identity: :func:`job_identity`.
        interval: steps between snapshots.
        rank, world, ranks_per_node: this rank's place (for its partner and source).
        group: the gloo group the replicas travel over.
    """

    def __init__(self, folder: SnapshotFolder, identity: Dict[str, str], interval: int, *, rank: int, world: int,
                 ranks_per_node: int, group: dist.ProcessGroup):
        self.folder, self.identity, self.interval = folder, identity, interval
        self.rank, self.world, self.ranks_per_node, self.group = rank, world, ranks_per_node, group
        self.partner = partner_of(rank, world, ranks_per_node)
        self.source = source_of(rank, world, ranks_per_node)
        self.own_step: Optional[int] = None  # the complete own snapshot kept now
        self.replica_step: Optional[int] = None  # the complete replica kept now
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hyper_parallel-snapshot")
        self._pending: Optional[concurrent.futures.Future] = None
        self.taken = self.deferred = 0  # snapshots started; due steps deferred (one still in flight)
        self._overdue = False  # the last due snapshot was deferred

    def partner_for(self, rank: int) -> Optional[int]:
        """The partner of any ``rank`` of the job."""
        return partner_of(rank, self.world, self.ranks_per_node)

    def due(self, step: int) -> bool:
        """Whether a snapshot is due after ``step``: every ``interval`` steps, and at each step
        after a deferred one until it is taken."""
        return step % self.interval == 0 or self._overdue

    def in_flight(self) -> bool:
        """Whether this rank's last snapshot is still being written or replicated."""
        return self._pending is not None and not self._pending.done()

    def info(self, step: int) -> Dict[str, Any]:
        """What ``snapshot.json`` holds for this rank's snapshot of ``step``."""
        return {**self.identity, "rank": self.rank, "step": step, "world_size": self.world}

    def take(self, step: int, state: Dict[str, Any], *, busy_ranks: int = 0) -> None:
        """Snapshot ``state`` as ``step``: planned here (its non-tensor values read now), its
        tensors staged before the next ``optimizer.step()``, the rest in the background. With
        ``busy_ranks`` (the ranks whose :meth:`in_flight` was true at this step's vote, the same
        number on every rank) the snapshot is deferred to the next step instead."""
        if busy_ranks:
            self._overdue = True
            self.deferred += 1
            return
        self._overdue = False
        self.taken += 1
        self.wait()  # done already on every rank (none was in flight at the vote)
        scratch = self.folder.scratch(f"step-{step}")
        writer = FileSystemWriter(scratch, sync_files=False)  # host memory: nothing to sync
        future = async_save(local_shards(state), storage_writer=writer, no_dist=True, use_collectives=False,
                            stage_in_background=True)
        self._pending = self._executor.submit(self._complete, step, future, scratch)

    def wait(self) -> None:
        """Until the last snapshot is in place and replicated (or given up)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def counts_line(self) -> str:
        """The console line of how many snapshots were taken and deferred."""
        return (f"memory snapshots: {self.taken} taken, {self.deferred} due step(s) deferred "
                "(the previous snapshot still in flight)")

    def remove(self) -> None:
        """Delete this rank's snapshots (the job has finished)."""
        self.wait()
        self._executor.shutdown()
        self.folder.remove()

    def _complete(self, step: int, future: concurrent.futures.Future, scratch: str) -> None:
        own = self.folder.own(step)
        try:
            future.result()
            with open(os.path.join(scratch, SNAPSHOT_INFO), "w") as f:
                json.dump(self.info(step), f)
            switch_into_place(scratch, own)
            written = True
        except (OSError, CheckpointError) as err:
            _log.warning("rank %d: the memory snapshot of step %d failed (%s); keeping step %s",
                         self.rank, step, err, self.own_step)
            shutil.rmtree(scratch, ignore_errors=True)
            written = False
        previous = None if self.own_step is None else self.folder.own(self.own_step)
        if not self._everywhere(written, f"the memory snapshot of step {step}", own, previous):
            return
        self.own_step = step
        if self.partner is not None:
            self._replicate(step, own)

    def _replicate(self, step: int, own: str) -> None:
        """Send the own snapshot of ``step`` to the partner, keep the source's as a replica (on one
        node: copy the source's, in place on every rank now)."""
        final = self.folder.replica(self.source, step)
        received = False
        try:
            if self.world <= self.ranks_per_node:
                scratch = self.folder.scratch(f"replica-{step}")
                shutil.copytree(self.folder.of_rank(self.source).own(step), scratch, dirs_exist_ok=True)
            else:
                scratch = transfer([(self.partner, mapped_or_nothing(own))], self.source,
                                   lambda: self.folder.scratch(f"replica-{step}"), self.group)
            if scratch is not None:
                switch_into_place(scratch, final)
                received = True
        except (OSError, CheckpointError) as err:  # every byte was exchanged: the group is usable
            _log.warning("rank %d: the replica of step %d failed: %s", self.rank, step, err)
        except RuntimeError as err:  # a rank is gone: the job is being restarted
            _log.warning("rank %d: the replica of step %d was not exchanged: %s", self.rank, step, err)
            return
        previous = None if self.replica_step is None else self.folder.replica(self.source, self.replica_step)
        if self._everywhere(received, f"the replica of step {step}", final, previous):
            self.replica_step = step

    def _everywhere(self, done: bool, what: str, new: str, previous: Optional[str]) -> bool:
        """Whether every rank has done its part (``done`` here: ``new`` is in place): then
        ``previous`` is deleted; else ``new`` is, and the previous one stays. False also when
        a rank is gone (logged)."""
        try:
            everywhere = all_ranks_agree(done, self.group)
        except RuntimeError as err:  # a rank is gone: the job is being restarted
            _log.warning("rank %d: %s was not confirmed: %s", self.rank, what, err)
            return False
        if not everywhere:
            if done:
                shutil.rmtree(new, ignore_errors=True)
            return False
        if previous is not None and previous != new:
            shutil.rmtree(previous, ignore_errors=True)
        return True


class SnapshotPlan(NamedTuple):
    """How much host memory the snapshots take: per rank and per node (own snapshot, replica and
    the one being written: three times a rank's state)."""

    rank_bytes: int
    node_bytes: int


def snapshot_memory(state: Dict[str, Any], ranks_per_node: int) -> SnapshotPlan:
    """The host memory the snapshots of ``state`` take at most (see :class:`SnapshotPlan`)."""
    rank = local_state_bytes(state)
    return SnapshotPlan(rank, 3 * rank * ranks_per_node)


def build_snapshots(checkpoint: MemorySnapshotKeys, identity: Dict[str, str], rank: int,
                    world: int) -> MemorySnapshots:
    """This rank's :class:`MemorySnapshots` (``checkpoint.memory_interval > 0``) for the job
    ``identity`` (:func:`job_identity`): the gloo group of the replicas (made by every rank
    together), and its folder, created.

    Raises:
        OSError: the folder cannot be created.
    """
    group = dist.new_group(backend="gloo")
    folder = SnapshotFolder(checkpoint.memory_dir, identity["job"], rank)
    os.makedirs(folder.path, exist_ok=True)
    return MemorySnapshots(folder, identity, checkpoint.memory_interval, rank=rank, world=world,
                           ranks_per_node=ranks_per_node(), group=group)


def ranks_per_node() -> int:
    """Ranks on this machine (torchrun's ``LOCAL_WORLD_SIZE``; 1 without it)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
