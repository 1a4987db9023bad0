"""A restarted job's start from the in-memory snapshots (memory_snapshots.py).

Every rank checks the snapshots in its folder with the durable checkpoint's checks (the job
identity in ``snapshot.json``, then ``verify_checkpoint``: metadata, file sizes, checksums); the
ranks exchange what passed (``all_gather_object`` over the snapshot group) and agree on the
newest step of which every rank's snapshot is held somewhere: on its own node (its folder, or
another folder there: a requeued job's ranks may land on other nodes), else as a replica on
another node, whose rank then sends it over the group. Each rank loads that step from its own
folder, no durable storage read. With no such step, or a newer durable checkpoint, the job resumes from
durable storage as without snapshots.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch.distributed as dist

from hyper_parallel.checkpoint import CheckpointError, committed_steps, load, verify_checkpoint
from hyper_parallel.trainer.step.agreement import together
from hyper_parallel.trainer.config.compose import ConfigError
from hyper_parallel.trainer.job import TrainingJob
from hyper_parallel.trainer.checkpointing.memory_snapshots import SNAPSHOT_INFO, MemorySnapshots, local_shards, switch_into_place
from hyper_parallel.trainer.checkpointing.snapshot_transfer import mapped_or_nothing, transfer
from hyper_parallel.trainer.checkpointing.operations import LoadPlan
from hyper_parallel.trainer.checkpointing.state import SAVED_ONLY

RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # torchrun sets it in restarted workers


class Candidates(NamedTuple):
    """What one rank can offer: the ``(rank, step)`` snapshots in its node's folder that pass
    the checks (its own, other local ranks', replicas), its node (host and folder), the
    snapshots it refused (one line each), other jobs' folders it saw, and (rank 0) the newest
    durable checkpoint's step."""

    held: List[Tuple[int, int]]
    node: Tuple[str, str]
    refused: List[str]
    other_jobs: List[str]
    durable: Optional[int] = None


class Recovery(NamedTuple):
    """The outcome: the step loaded from memory (None: none), the lines to print (refused
    snapshots, other jobs'), whether this job had snapshots to look at, the ranks whose state
    came from another node (a partner's replica), and this rank's snapshot loaded."""

    step: Optional[int]
    lines: List[str]
    found: bool
    from_replica: List[int]
    path: Optional[str] = None


def _refusal(path: str, identity: Dict[str, str], world: int, rank: int, step: int) -> Optional[str]:
    """Why the snapshot at ``path`` cannot be loaded as ``rank``'s of ``step`` by a job of
    ``world`` ranks (None: it can)."""
    try:
        with open(os.path.join(path, SNAPSHOT_INFO)) as f:
            info = json.load(f)
    except (OSError, ValueError) as err:
        return f"{path}: no readable {SNAPSHOT_INFO} ({err})"
    if not isinstance(info, dict) or info.get("job") != identity["job"]:
        owner = info.get("output_dir") if isinstance(info, dict) else None
        return f"{path}: written by another job (output_dir {owner}); not loaded"
    if info.get("world_size") != world:
        return f"{path}: written by a job of {info.get('world_size')} ranks, this one has {world}; not loaded"
    if info.get("rank") != rank or info.get("step") != step:
        return f"{path}: holds rank {info.get('rank')}'s step {info.get('step')}, not rank {rank}'s step {step}"
    try:
        verify_checkpoint(path)
    except CheckpointError as err:
        return f"{path}: refused, {str(err).strip().splitlines()[0]}"
    return None


def other_jobs(memory_dir: str, root: str) -> List[str]:
    """The other jobs' snapshot folders in ``memory_dir``, each with its ``output_dir`` when known."""
    found = []
    for name in sorted(os.listdir(memory_dir)) if os.path.isdir(memory_dir) else []:
        path = os.path.join(memory_dir, name)
        if not name.startswith("job-") or path == root or not os.path.isdir(path):
            continue
        owner = None
        for dirpath, _, files in os.walk(path):
            if SNAPSHOT_INFO in files:
                try:
                    with open(os.path.join(dirpath, SNAPSHOT_INFO)) as f:
                        owner = json.load(f).get("output_dir")
                except (OSError, ValueError, AttributeError):
                    continue
                break
        found.append(f"{path} (output_dir {owner})" if owner else path)
    return found


def node_snapshots(snapshots: MemorySnapshots, folders: Sequence[int]) -> Dict[Tuple[int, int], str]:
    """The snapshots in the rank folders ``folders`` of this node: ``(rank, step)`` -> path (a
    requeued job's ranks may land on other nodes than before: any folder may hold any rank's)."""
    found: Dict[Tuple[int, int], str] = {}
    for folder in folders:
        own, replicas = snapshots.folder.of_rank(folder).listing()
        found.update({(folder, step): path for step, path in own.items()})
        found.update({key: path for key, path in replicas.items() if key not in found})
    return found


def local_candidates(snapshots: MemorySnapshots, found: Dict[Tuple[int, int], str],
                     durable_folder: Optional[str]) -> Candidates:
    """This rank's :class:`Candidates` among ``found`` (the durable step listed on rank 0 when
    ``durable_folder``)."""
    refused: List[str] = []
    held = []
    for (rank, step), path in sorted(found.items()):
        why = _refusal(path, snapshots.identity, snapshots.world, rank, step)
        if why is None:
            held.append((rank, step))
        else:
            refused.append(f"memory snapshot {why}")
    durable = None
    if durable_folder is not None and snapshots.rank == 0:
        steps = committed_steps(durable_folder)
        durable = steps[-1] if steps else None
    return Candidates(held, node_of(snapshots), refused, other_jobs(snapshots.folder.memory_dir, snapshots.folder.root), durable)


def agreed_step(everyone: Sequence[Candidates]) -> Optional[int]:
    """The newest step of which every rank's snapshot is held by some rank; None when there is none."""
    world = len(everyone)
    steps: Dict[int, Set[int]] = {}
    for mine in everyone:
        for rank, step in mine.held:
            steps.setdefault(step, set()).add(rank)
    whole = [step for step, ranks in steps.items() if len(ranks) == world]
    return max(whole) if whole else None


def node_of(snapshots: MemorySnapshots) -> Tuple[str, str]:
    """This rank's node: its host and its ``memory_dir`` (two "nodes" may share a host)."""
    return socket.gethostname(), os.path.realpath(snapshots.folder.memory_dir)


def holders(everyone: Sequence[Candidates], step: int) -> List[int]:
    """For each rank, the rank that gives it its snapshot of ``step``: itself when its node holds
    it, else the lowest rank that does."""
    chosen = []
    for q in range(len(everyone)):
        having = [h for h, mine in enumerate(everyone) if (q, step) in mine.held]
        chosen.append(q if any(everyone[h].node == everyone[q].node for h in having) else min(having))
    return chosen


def recover_from_memory(snapshots: MemorySnapshots, state: Dict[str, Any], keys: Sequence[str],
                        durable_folder: Optional[str]) -> Recovery:
    """Agree on a step, send each rank's snapshot of it to the ranks whose node lacks it, load
    ``keys`` of ``state`` from it (collective over the snapshot group). This rank's snapshot
    of it ends in its own folder; every other snapshot on the node is deleted. ``durable_folder``:
    the job's checkpoint folder (a newer durable checkpoint wins), None: not resuming from it.

    Raises:
        ConfigError: the agreed snapshot failed to load on some rank.
    """
    group, world, me = snapshots.group, snapshots.world, snapshots.rank
    nodes: List[Optional[Tuple[str, str]]] = [None] * world
    dist.all_gather_object(nodes, node_of(snapshots), group=group)
    local_ranks = [q for q in range(world) if nodes[q] == nodes[me]]
    # Each rank checks its own folder; the node's lowest rank also those of ranks not on it now.
    folders = [me] + ([q for q in snapshots.folder.ranks_here() if q not in local_ranks]
                      if me == min(local_ranks) else [])
    found = node_snapshots(snapshots, folders)
    everyone: List[Optional[Candidates]] = [None] * world
    dist.all_gather_object(everyone, local_candidates(snapshots, found, durable_folder), group=group)
    lines = list(dict.fromkeys(line for c in everyone for line in c.refused))
    lines += [f"ignoring the memory snapshots of another job: {other} (never loaded; delete them to free the memory)"
              for other in dict.fromkeys(o for c in everyone for o in c.other_jobs)]
    found_any = any(c.held or c.refused for c in everyone)
    step = agreed_step(everyone)
    durable = everyone[0].durable
    if step is None or (durable is not None and durable > step):
        _clean_node(snapshots, local_ranks, keep=[])
        return Recovery(None, lines, found_any, [])
    given_by = holders(everyone, step)
    own = snapshots.folder.own(step)
    problem = None
    try:
        sends = [(q, mapped_or_nothing(found[(q, step)])) for q in range(world) if given_by[q] == me and q != me]
        received = transfer(sends, given_by[me] if given_by[me] != me else None,
                            lambda: snapshots.folder.scratch(f"step-{step}"), group)
        if given_by[me] != me:
            if received is None:
                raise CheckpointError(f"rank {given_by[me]} could not send it")
            switch_into_place(received, own)
        elif (me, step) not in found or found[(me, step)] != own:
            # a replica, or in the folder of the rank this node had before: as this rank's own
            held_here = node_snapshots(snapshots, snapshots.folder.ranks_here())[(me, step)]
            os.makedirs(snapshots.folder.path, exist_ok=True)
            switch_into_place(held_here, own)
        # A snapshot received now is checked by this load; one checked above is not read twice.
        load(local_shards({key: state[key] for key in keys}), checkpoint_id=own, no_dist=True,
             verify=given_by[me] != me)
    except (OSError, CheckpointError) as err:
        problem = f"rank {me}: the memory snapshot of step {step} ({own}) failed to load: {err}"
    failed: List[Optional[str]] = [None] * world
    dist.all_gather_object(failed, problem, group=group)
    if any(failed):
        raise ConfigError(next(p for p in failed if p))
    _clean_node(snapshots, local_ranks, keep=[snapshots.folder.of_rank(q).own(step) for q in local_ranks])
    snapshots.own_step, snapshots.replica_step = step, None
    return Recovery(step, lines, found_any, [q for q in range(world) if everyone[given_by[q]].node != everyone[q].node],
                    own)


def _clean_node(snapshots: MemorySnapshots, local_ranks: List[int], keep: List[str]) -> None:
    """Delete this job's snapshots on this node but ``keep`` (each rank its own folder; the
    node's lowest rank the folders of ranks that are no longer on it)."""
    dist.barrier(group=snapshots.group)  # every rank has read what it needed
    mine = [snapshots.rank] + ([q for q in snapshots.folder.ranks_here() if q not in local_ranks]
                               if snapshots.rank == min(local_ranks) else [])
    for q in mine:
        folder = snapshots.folder.of_rank(q)
        if q == snapshots.rank:
            os.makedirs(folder.path, exist_ok=True)
            folder.keep_only(keep)
        else:
            folder.remove()


def was_restarted() -> bool:
    """Whether torchrun restarted this worker (``--max-restarts``)."""
    return int(os.environ.get(RESTART_COUNT, "0") or 0) > 0


def start_from(job: TrainingJob, resume_durable: Callable[[], Optional[LoadPlan]]
               ) -> Tuple[Optional[LoadPlan], List[str], Optional[Dict[str, Any]]]:
    """Where the job starts: with snapshots on (and ``checkpoint.resume`` without a
    ``load_step``), the snapshots every rank can get (:func:`recover_from_memory`), else
    ``resume_durable()``. Returns the plan (None: from scratch), the lines to print, and the
    ``metrics.jsonl`` row of a recovery (from memory; from durable storage after a torchrun
    restart or when snapshots were found): ``{"event": "recovered", "from": "memory" |
    "durable", "step", "seconds"}``.

    Raises:
        JobFailed: on every rank, as ``resume_durable``, or when a snapshot agreed on fails to load.
    """
    started = time.perf_counter()
    snapshots, c = job.snapshots, job.cfg.checkpoint
    recovery = Recovery(None, [], False, [])
    if snapshots is not None and c.resume and c.load_step is None:
        keys = [key for key in job.state if key not in SAVED_ONLY]
        recovery = together(job.device, lambda: recover_from_memory(snapshots, job.state, keys, c.folder))
    if recovery.step is not None:
        seconds = time.perf_counter() - started
        ranks = recovery.from_replica
        whose = (f"; rank(s) {', '.join(map(str, ranks))} from their partner's replica" if ranks
                 else "; every rank from its own node")
        line = f"recovered from memory at step {recovery.step} in {seconds:.2f} s{whose}"
        plan = LoadPlan(recovery.path, keys, recovery.step, line)
        return plan, recovery.lines, {"event": "recovered", "from": "memory", "step": recovery.step,
                                      "seconds": round(seconds, 4)}
    plan = resume_durable()
    if plan is None or not (recovery.found or was_restarted()):
        return plan, recovery.lines, None
    seconds = time.perf_counter() - started
    why = "no memory snapshot every rank can get" if snapshots is not None else "no memory snapshots"
    line = f"recovered from durable at step {plan.start_step} in {seconds:.2f} s ({why})"
    return plan, recovery.lines + [line], {"event": "recovered", "from": "durable", "step": plan.start_step,
                                           "seconds": round(seconds, 4)}
