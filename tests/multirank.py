"""Run test functions on N ranks (gloo on CPU; nccl on CUDA, one GPU per rank), reusing the
worker processes between tests.

A pool of N spawned processes joins one gloo process group on loopback once; each
``run(fn, *args)`` ships ``fn`` (a module-level function, pickled by reference) to every
rank and returns the per-rank results. A rank that raises makes ``run`` raise with that
rank's traceback; a call that does not finish within its timeout kills the pool (ranks stuck
in a collective cannot be recovered) and the next call starts a fresh one. After each call a
rank resets the module-level caches a test may have filled (``tests/process_state.py``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable, List

from hyper_parallel.platform import free_port
from tests.process_state import reset_process_state

_SPAWN = mp.get_context("spawn")


class RankError(AssertionError):
    """A rank raised; the message holds its traceback."""


def _worker(rank: int, world_size: int, port: int, conn, device: str = "cpu") -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        HYPER_PARALLEL_DEVICE=device,
    )
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=120)
    )
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            try:
                result = fn(*args, **kwargs)
            finally:
                reset_process_state()  # the next test starts as on a fresh process
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            conn.send(("error", traceback.format_exc()))
    os._exit(0)  # no destroy_process_group: its shutdown took seconds per pool; the peers exit too


class RankPool:
    """N persistent ranks on ``device`` ("cpu": gloo; "cuda": nccl, one GPU each)."""

    def __init__(self, world_size: int, device: str = "cpu"):
        self.world_size = world_size
        self.device = device
        self._procs: List[Any] = []
        self._conns: List[Any] = []

    def _start(self, timeout: float = 120.0) -> None:
        port = free_port()
        for rank in range(self.world_size):
            parent, child = _SPAWN.Pipe()
            proc = _SPAWN.Process(
                target=_worker, args=(rank, self.world_size, port, child, self.device), daemon=True
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect(timeout, what="start-up")

    def _collect(self, timeout: float, what: str) -> List[Any]:
        deadline = time.monotonic() + timeout
        results: dict = {}
        errors: dict = {}
        pending = dict(enumerate(self._conns))
        while pending:
            remaining = deadline - time.monotonic()
            # Once one rank failed, the others get a short grace period: they are
            # usually blocked in a collective the failed rank will never join.
            if errors:
                remaining = min(remaining, 5.0)
            ready = wait(list(pending.values()), timeout=max(remaining, 0))
            if not ready:
                break
            for conn in ready:
                rank = next(r for r, c in pending.items() if c is conn)
                del pending[rank]
                try:
                    status, payload = conn.recv()
                except EOFError:
                    status, payload = "error", f"rank {rank} died (exit code {self._procs[rank].exitcode})"
                if status == "error":
                    errors[rank] = payload
                else:
                    results[rank] = payload
        if errors or pending:
            self.close(force=True)
        if errors:
            first = min(errors)
            raise RankError(f"rank {first} of {self.world_size} failed in {what}:\n{errors[first]}")
        if pending:
            raise TimeoutError(
                f"{what} did not finish on ranks {sorted(pending)} of {self.world_size} "
                f"within {timeout:.0f}s"
            )
        return [results[r] for r in range(self.world_size)]

    def run(self, fn: Callable, *args, timeout: float = 180.0, **kwargs) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Raises:
            RankError: a rank raised (message: its traceback).
            TimeoutError: some rank did not finish within ``timeout`` seconds.
        """
        if not self._procs:
            self._start()
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return self._collect(timeout, what=getattr(fn, "__qualname__", repr(fn)))

    def close(self, force: bool = False) -> None:
        if not force:
            self.ask_to_stop()
        self.join(force)

    def ask_to_stop(self) -> None:
        """Tell every rank to leave its loop (they exit on their own; :meth:`join` waits)."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass

    def join(self, force: bool = False) -> None:
        """Wait for the ranks to exit (``force``: kill them at once), then forget them."""
        for proc in self._procs:
            proc.join(timeout=0 if force else 10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)
        self._procs, self._conns = [], []


_POOLS: dict = {}


def run_on_ranks(world_size: int, fn: Callable, *args, timeout: float = 180.0, device: str = "cpu",
                 **kwargs) -> List[Any]:
    """Run ``fn`` on a shared pool of ``world_size`` ranks on ``device`` (created on first use)."""
    pool = _POOLS.get((world_size, device))
    if pool is None:
        pool = _POOLS[world_size, device] = RankPool(world_size, device)
    return pool.run(fn, *args, timeout=timeout, **kwargs)


def close_all_pools() -> None:
    for pool in _POOLS.values():  # every pool's ranks exit at the same time
        pool.ask_to_stop()
    for pool in _POOLS.values():
        pool.join()
    _POOLS.clear()
