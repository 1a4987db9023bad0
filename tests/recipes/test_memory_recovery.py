"""In-memory snapshots (``checkpoint.memory_interval``): a killed worker restarted by torchrun and
a lost node requeued resume from memory on the uninterrupted losses; damaged snapshots fall back
to the durable checkpoint; another job's snapshots are named and never loaded."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
import time

import pytest
import torch.distributed as dist

from hyper_parallel.platform import free_port, get_platform
from hyper_parallel.trainer import compose_config, run_training, validate_config
from tests.multirank import run_on_ranks
from tests.recipes.launch import (RECIPE, TINY, assert_losses_match, end, finish, last_loss_per_step, read_events,
                                  read_records, start, torchrun_cmd, wait_for_step, worker_pids)

STEPS = 12
# Snapshots every step; no durable checkpoint before the last step.
SNAPSHOTS = ["checkpoint.memory_interval=1", "checkpoint.interval=1000"]


def _train(overrides):
    """The recipe's training on this rank, its console output (rank 0's) returned."""
    cfg = compose_config([*TINY, *overrides])
    with tempfile.TemporaryFile("w+") as out, _stdout_to(out):
        run_training(validate_config(cfg, dist.get_world_size()), get_platform())
        out.seek(0)
        return out.read()


@contextlib.contextmanager
def _stdout_to(file):
    """File descriptor 1 into ``file`` (the metrics logger holds sys.stdout, bound at import)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(file.fileno(), 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _crash_after(step, overrides):
    """As _train, the job dying in the step after ``step`` (on every rank, the snapshots left)."""
    from hyper_parallel.trainer import loop

    original = loop.train_step

    def dying(*args, **kwargs):
        if loop.train_step.calls == step:
            raise RuntimeError("simulated crash")
        loop.train_step.calls += 1
        return original(*args, **kwargs)

    dying.calls = 0
    loop.train_step = dying
    try:
        _train(overrides)
    except RuntimeError as err:
        return str(err)
    finally:
        loop.train_step = original
    return "no crash"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted 2-rank losses, without snapshots (2 gloo ranks in-process)."""
    out = str(tmp_path_factory.mktemp("reference"))
    run_on_ranks(2, _train, [f"output_dir={out}"], timeout=300)
    return last_loss_per_step(out)


def _recovered(out):
    return [e for e in read_events(out) if e["event"] == "recovered"]


def _steps_rerun(out):
    """How many steps logged before the recovery were run again after it."""
    rows = read_records(out)
    at = next(i for i, r in enumerate(rows) if r.get("event") == "recovered")
    return max(r["step"] for r in rows[:at]) - rows[at]["step"]


def _wait_for_replica_of_newest_steps(out, held_by, proc, timeout=240):
    """Until step 5 is logged and the folder ``held_by`` (rank 0's) holds the replica of rank 1's
    snapshot of the newest step logged or the one before: a snapshot due while the previous one
    is in flight is deferred (on a loaded machine even the tiny model's can be), so the newest
    complete snapshot trails the steps by a varying amount; the kill comes when it is recent."""
    wait_for_step(out, 5, proc, timeout=timeout)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logged = max(r["step"] for r in read_records(out) if "event" not in r)
        names = list(held_by.glob("job-*/rank-0/replica-of-1-step-*"))
        if any(int(n.name.rsplit("-", 1)[1]) >= logged - 1 for n in names):
            return
        if proc.poll() is not None:
            raise AssertionError(f"the job ended first:\n{proc.stdout.read()}")
        time.sleep(0.01)
    raise AssertionError(f"no replica of a recent step within {timeout}s")


def test_a_killed_worker_resumes_from_memory_on_the_uninterrupted_losses(reference, tmp_path):
    out, memory = str(tmp_path / "out"), tmp_path / "memory"
    proc = start(torchrun_cmd(2, [*TINY, *SNAPSHOTS, f"output_dir={out}", f"checkpoint.memory_dir={memory}"],
                              extra=["--standalone", "--max-restarts=1", "--monitor-interval=0.1"]))
    _wait_for_replica_of_newest_steps(out, memory, proc)
    workers = worker_pids(proc.pid)
    assert 1 in workers, f"rank 1 not found among torchrun's children {workers}"
    os.kill(workers[1], signal.SIGKILL)
    output = finish(proc, timeout=300)
    assert proc.returncode == 0, output
    [event] = _recovered(out)
    assert event["from"] == "memory" and event["step"] >= 4 and event["seconds"] > 0, event
    assert f"recovered from memory at step {event['step']} in " in output
    assert _steps_rerun(out) <= 2
    assert not os.path.exists(os.path.join(out, "checkpoints", f"step-{event['step']}"))  # no durable one read
    assert_losses_match(reference, last_loss_per_step(out))
    assert os.listdir(memory) == [], "the finished job left snapshots behind"


def test_a_lost_node_requeued_resumes_from_its_partners_replica(reference, tmp_path):
    """Two torchrun agents ("nodes", one rank each, c10d on loopback); one node lost whole
    after step 5 (agent, worker and memory folder), then both started again."""
    out = str(tmp_path / "out")
    memory = [tmp_path / "node0", tmp_path / "node1"]

    def node(i, endpoint):
        return start([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
                      "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", "--rdzv_id=memory",
                      "--monitor-interval=0.1", RECIPE, *TINY, *SNAPSHOTS, f"output_dir={out}",
                      f"checkpoint.memory_dir={memory[i]}"])

    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [node(0, endpoint), node(1, endpoint)]
    wait_for_step(out, 5, nodes[0], timeout=240)
    lost = next(i for i, n in enumerate(nodes) if 1 in worker_pids(n.pid))  # the node of rank 1
    _wait_for_replica_of_newest_steps(out, memory[1 - lost], nodes[lost])
    end(nodes[lost])
    shutil.rmtree(memory[lost])
    for n in nodes:  # the other node's job fails without its peer: the scheduler's requeue
        end(n)
        n.communicate()
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [node(0, endpoint), node(1, endpoint)]
    outputs = [finish(n, timeout=300) for n in nodes]
    assert all(n.returncode == 0 for n in nodes), "\n".join(outputs)
    [event] = _recovered(out)
    assert event["from"] == "memory" and event["step"] >= 4, event
    assert "from their partner's replica" in "".join(outputs)
    assert_losses_match(reference, last_loss_per_step(out))
    assert os.listdir(memory[0]) == [] and os.listdir(memory[1]) == []


def test_damaged_snapshots_fall_back_to_durable_and_another_jobs_are_ignored(reference, tmp_path):
    out, memory = str(tmp_path / "out"), str(tmp_path / "memory")
    job = [*SNAPSHOTS, f"output_dir={out}", f"checkpoint.memory_dir={memory}", "checkpoint.interval=3"]
    assert run_on_ranks(2, _crash_after, 5, job, timeout=300) == ["simulated crash"] * 2
    [job_folder] = os.listdir(memory)

    # Another job (another output_dir) with the same memory_dir: names them, never loads them.
    other = str(tmp_path / "other")
    console = run_on_ranks(2, _train, [*SNAPSHOTS, f"output_dir={other}", f"checkpoint.memory_dir={memory}",
                                       "training.steps=1"], timeout=300)[0]
    assert (f"ignoring the memory snapshots of another job: {memory}/{job_folder} (output_dir {out})"
            in console), console
    assert "starting from scratch" in console
    assert last_loss_per_step(other)[1] == reference[1]

    # Every state of rank 1 in memory damaged: its own snapshots (the newest, and the one before
    # it when a deferral kept it, which may be the durable step's) and their replicas on rank 0
    # (one of a step whose own snapshot was still being written at the crash included): the
    # durable step 3 is the newest complete state.
    own = [int(name.rsplit("-", 1)[1]) for name in os.listdir(f"{memory}/{job_folder}/rank-1")
           if name.startswith("step-")]
    replicas = [int(name.rsplit("-", 1)[1]) for name in os.listdir(f"{memory}/{job_folder}/rank-0")
                if name.startswith("replica-of-1-step-")]
    newest = max(own)
    for step in set(own) | set(replicas):
        for path in (f"{memory}/{job_folder}/rank-1/step-{step}",
                     f"{memory}/{job_folder}/rank-0/replica-of-1-step-{step}"):
            data = os.path.join(path, "__0_0.safetensors")
            if not os.path.exists(data):
                continue  # the replica of a snapshot still in flight at the crash
            corrupt = bytearray(open(data, "rb").read())
            corrupt[-1] ^= 0xFF
            open(data, "wb").write(bytes(corrupt))
    console = run_on_ranks(2, _train, job, timeout=300)[0]
    [event] = _recovered(out)
    assert event["from"] == "durable" and event["step"] == 3, event
    assert f"rank-1/step-{newest}: refused, " in console and "checksum" in console, console
    assert_losses_match(reference, last_loss_per_step(out))
    assert os.listdir(memory) == []  # both jobs finished


def _crash_after_without_collective_replicas(step, overrides):
    """_crash_after with the collective transfer of replicas failing: on one node (the ranks of a
    pool) a replica is a copy of the source's folder."""
    from unittest import mock

    from hyper_parallel.trainer.checkpointing import memory_snapshots

    with mock.patch.object(memory_snapshots, "transfer", side_effect=AssertionError("a replica sent on one node")):
        return _crash_after(step, overrides)


def test_an_hsdp_job_resumes_from_memory_on_the_uninterrupted_losses(tmp_path):
    """HSDP 2x2 (4 gloo ranks of one node: replicated shards, each rank its own snapshot, the
    replica of the previous rank's copied within the node): a job that died after step 5 resumes
    from its snapshots on the losses of a run that was not interrupted."""
    layout = ["parallel.dp_replicate=2", "parallel.dp_shard=2", "training.steps=8"]
    reference = str(tmp_path / "reference")
    run_on_ranks(4, _train, [*layout, f"output_dir={reference}"], timeout=300)
    out, memory = str(tmp_path / "out"), str(tmp_path / "memory")
    job = [*layout, *SNAPSHOTS, f"output_dir={out}", f"checkpoint.memory_dir={memory}"]
    assert run_on_ranks(4, _crash_after_without_collective_replicas, 5, job, timeout=300) == ["simulated crash"] * 4
    [job_folder] = os.listdir(memory)
    for rank in range(4):  # each holds a replica of the previous rank's snapshot, none sent
        names = os.listdir(f"{memory}/{job_folder}/rank-{rank}")
        assert any(re.fullmatch(rf"replica-of-{(rank - 1) % 4}-step-\d+", name) for name in names), names
    console = run_on_ranks(4, _train, job, timeout=300)[0]
    [event] = _recovered(out)
    assert event["from"] == "memory" and 1 <= event["step"] <= 5, (event, console)
    assert_losses_match(last_loss_per_step(reference), last_loss_per_step(out))
    assert os.listdir(memory) == []


def _train_with_a_snapshot_in_flight(overrides):
    """As _train, rank 1's snapshot of step 2 held in flight (its write done, not yet switched
    in and replicated) until rank 1 is told to defer a due snapshot (20 s at most)."""
    import threading

    from hyper_parallel.trainer.checkpointing.memory_snapshots import MemorySnapshots

    complete, take, deferred = MemorySnapshots._complete, MemorySnapshots.take, threading.Event()

    def held(self, step, *args):
        if step == 2 and self.rank == 1:
            deferred.wait(20)
        return complete(self, step, *args)

    def noting(self, step, state, **kwargs):
        if kwargs.get("busy_ranks"):
            deferred.set()
        return take(self, step, state, **kwargs)

    MemorySnapshots._complete, MemorySnapshots.take = held, noting
    try:
        return _train(overrides), deferred.is_set()
    finally:
        MemorySnapshots._complete, MemorySnapshots.take = complete, take


def test_a_snapshot_in_flight_defers_the_next_without_holding_the_steps(reference, tmp_path):
    """The steps go on while a snapshot is in flight on one rank; every rank defers the due ones
    (the vote rides on the step's all-reduce) until it is in place; training is unchanged."""
    out, memory = str(tmp_path / "out"), tmp_path / "memory"
    (console, _), (_, rank1_deferred) = run_on_ranks(
        2, _train_with_a_snapshot_in_flight, [*SNAPSHOTS, f"output_dir={out}", f"checkpoint.memory_dir={memory}"],
        timeout=300)
    assert rank1_deferred, "rank 1 waited for its snapshot in flight instead of deferring the next one"
    taken, deferred = map(int, re.search(r"memory snapshots: (\d+) taken, (\d+) due step\(s\) deferred",
                                         console).groups())
    assert deferred >= 1 and taken >= 2 and taken + deferred == STEPS - 1, console
    assert_losses_match(reference, last_loss_per_step(out))
    assert os.listdir(memory) == []


def test_partners_and_the_agreed_step():
    from hyper_parallel.trainer.checkpointing.memory_snapshots import partner_of, source_of
    from hyper_parallel.trainer.launch.recovery import Candidates, agreed_step, holders

    # The same local rank of the next node; on one node the next rank; none for one rank.
    assert [partner_of(r, 8, 4) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]
    assert [partner_of(r, 2, 2) for r in range(2)] == [1, 0] and partner_of(0, 1, 1) is None
    assert all(source_of(partner_of(r, 6, 2), 6, 2) == r for r in range(6))

    def node(held, name):
        return Candidates(held, ("host", name), [], [])
    # Rank 1's node was lost: its step 5 only as rank 0's replica; rank 0 has 6 too but not rank 1.
    everyone = [node([(0, 5), (0, 6), (1, 5)], "a"), node([], "b")]
    assert agreed_step(everyone) == 5 and holders(everyone, 5) == [0, 0]
    assert agreed_step([node([(0, 6)], "a"), node([(1, 5)], "b")]) is None
    # Two ranks of one node: each gives itself whatever its node holds.
    everyone = [node([(0, 4), (1, 4)], "a"), node([], "a")]
    assert holders(everyone, 4) == [0, 1]


def test_an_unusable_memory_dir_is_one_line_before_start(check, tmp_path):
    (tmp_path / "file").write_text("")
    code, _, err = check("checkpoint.memory_interval=1", f"checkpoint.memory_dir={tmp_path}/file/snapshots")
    assert code == 2 and f"checkpoint.memory_dir={tmp_path}/file/snapshots cannot be used: {tmp_path}/file is a file, not a folder" in err, err
    assert check(f"checkpoint.memory_dir={tmp_path}/file/snapshots")[0] == 0  # snapshots off: not used
