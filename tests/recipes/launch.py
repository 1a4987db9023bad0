"""Run the training recipe in subprocesses (torchrun or plain python) for the end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(REPO, "recipes", "train.py")

# Tiny and quick, yet long enough to learn something and to be interrupted.
TINY = [
    "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "training.seq_len=32", "training.global_batch_size=8", "training.steps=12",
    "optim.lr=1e-2", "optim.warmup_steps=2", "logging.log_every=1",
]


def env() -> Dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HYPER_PARALLEL_DEVICE": "cpu",
            "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"}


def torchrun_cmd(nproc: int, overrides: Sequence[str], *, extra: Sequence[str] = ()) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", *extra,
            RECIPE, *overrides]


def run(cmd: Sequence[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """Run to completion; the output is attached to assertion messages by the tests."""
    return subprocess.run(list(cmd), cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)


def start(cmd: Sequence[str], **kwargs) -> subprocess.Popen:
    """Start in its own session, so a timed-out job can be killed with everything it spawned."""
    return subprocess.Popen(list(cmd), cwd=REPO, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, **kwargs)


def read_metrics(output_dir: str) -> List[dict]:
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != parent:
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
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"job did not finish within {timeout}s:\n{out}")
    return out


def assert_losses_match(expected: Dict[int, float], actual: Dict[int, float], steps: Optional[range] = None,
                        rel: float = 1e-4) -> None:
    for step in steps or sorted(expected):
        a, b = expected[step], actual[step]
        assert abs(a - b) <= rel * abs(a), f"step {step}: loss {b} differs from the uninterrupted {a}"
