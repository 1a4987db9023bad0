"""Run the training recipe in subprocesses (torchrun or plain python) for the end-to-end tests.

Every process started here, and everything it starts (torchrun puts each rank in a session of
its own), carries this test session's mark in its environment; :func:`end_all` kills them all,
at the end of the test session (tests/recipes/conftest.py) and at interpreter exit, so an
interrupted test run (Ctrl-C) leaves no rank training.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(REPO, "recipes", "train.py")
# The environment variable marking the processes this test session started, and its value.
SESSION_MARK = "HYPER_PARALLEL_TEST_SESSION"
_SESSION = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
_started: List[subprocess.Popen] = []

# Tiny and quick, yet long enough to learn something and to be interrupted.
TINY = [
    "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "training.seq_len=32", "training.global_batch_size=8", "training.steps=12",
    "optim.lr=1e-2", "optim.warmup_steps=2", "logging.log_every=1",
]


def env() -> Dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HYPER_PARALLEL_DEVICE": "cpu",
            "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1", SESSION_MARK: _SESSION}


def torchrun_cmd(nproc: int, overrides: Sequence[str], *, extra: Sequence[str] = ()) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *extra,
            RECIPE, *overrides]


def run(cmd: Sequence[str], timeout: float = 120, extra_env: Optional[Dict[str, str]] = None
        ) -> subprocess.CompletedProcess:
    """Run to completion (stdout and stderr apart); the output is attached to assertion
    messages by the tests.

    Raises:
        subprocess.TimeoutExpired: it ran longer than ``timeout`` (it and its children are killed).
    """
    proc = start(cmd, stderr=subprocess.PIPE, extra_env=extra_env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end(proc)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start(cmd: Sequence[str], *, stderr=subprocess.STDOUT, extra_env: Optional[Dict[str, str]] = None,
          **kwargs) -> subprocess.Popen:
    """Start in its own session (stdout piped, stderr into it unless given), so a timed-out
    job can be killed with everything it spawned (:func:`end`)."""
    proc = subprocess.Popen(list(cmd), cwd=REPO, env={**env(), **(extra_env or {})}, stdout=subprocess.PIPE,
                            stderr=stderr, text=True, start_new_session=True, **kwargs)
    _started.append(proc)
    return proc


def _marked_pids() -> List[int]:
    """The live processes carrying this session's mark (its jobs and whatever they started)."""
    mark, pids = f"{SESSION_MARK}={_SESSION}".encode(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:  # gone meanwhile, or another user's
            continue
    return pids


def _kill(pid: int) -> None:
    """SIGKILL ``pid`` and its process group (never this process's own group)."""
    try:
        group = os.getpgid(pid)
        if group != os.getpgrp():
            os.killpg(group, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def end(proc: subprocess.Popen) -> None:
    """Kill ``proc``, its descendants and their process groups (torchrun's ranks run in
    sessions of their own)."""
    for pid in [proc.pid, *_descendants(proc.pid)]:
        _kill(pid)


def end_all() -> None:
    """Kill every job this test session started that is still running, with everything it
    started (found by the session's mark: ranks whose torchrun died are orphans)."""
    for proc in _started:
        if proc.poll() is None:
            end(proc)
    for pid in _marked_pids():
        _kill(pid)
    for proc in _started:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    _started.clear()


atexit.register(end_all)


def _descendants(parent: int) -> set:
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                children.setdefault(_ppid(int(entry)), []).append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    found, todo = set(), [parent]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def read_records(output_dir: str) -> List[dict]:
    """Every row of ``metrics.jsonl``: the steps and the events (``"event"``: e.g. a recovery)."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_metrics(output_dir: str) -> List[dict]:
    """The steps' rows of ``metrics.jsonl``."""
    return [r for r in read_records(output_dir) if "event" not in r]


def read_events(output_dir: str) -> List[dict]:
    """The events' rows of ``metrics.jsonl``."""
    return [r for r in read_records(output_dir) if "event" in r]


def last_loss_per_step(output_dir: str) -> Dict[int, float]:
    """Step -> loss, the last record winning (a restarted job logs resumed steps again)."""
    return {r["step"]: r["loss"] for r in read_metrics(output_dir)}


def wait_for_step(output_dir: str, step: int, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r["step"] >= step for r in read_metrics(output_dir)):
            return
        if proc.poll() is not None:
            raise AssertionError(f"job ended before step {step}:\n{proc.stdout.read()}")
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached within {timeout}s")


def worker_pids(parent: int) -> Dict[int, int]:
    """RANK -> pid of the recipe processes started by the torchrun agent ``parent``."""
    ranks = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if _ppid(int(entry)) != parent:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if b"RANK" in environ:
            ranks[int(environ[b"RANK"])] = int(entry)
    return ranks


def finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"job did not finish within {timeout}s:\n{out}")
    return out


def assert_losses_match(expected: Dict[int, float], actual: Dict[int, float], steps: Optional[range] = None,
                        rel: float = 1e-4) -> None:
    for step in steps or sorted(expected):
        a, b = expected[step], actual[step]
        assert abs(a - b) <= rel * abs(a), f"step {step}: loss {b} differs from the uninterrupted {a}"
