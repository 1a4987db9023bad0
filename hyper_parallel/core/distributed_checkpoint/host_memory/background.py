"""The background side of saves: one save in flight per process, its staging and write
threads, and the optimizer step pre-hooks that make in-place updates wait for staging.

[Note: staging in the background]
``async_save(..., stage_in_background=True)`` returns right after planning; the staging
copy (device-to-host on accelerators, a host snapshot on CPU) runs on a staging thread,
overlapped with the caller's next forward/backward, and the write follows on the write
thread. Until staging is complete nothing may change the saved tensors in place. What waits:

- ``optimizer.step()`` of every optimizer the save found in its state dict (a top-level
  ``torch.optim.Optimizer``, or a Stateful wrapper exposing one as ``optim``, such as
  ``OptimizerState``): the save installs a step pre-hook, once per optimizer, that waits for
  the process's pending staging (a dictionary lookup when nothing is pending);
- the next ``save``/``async_save``/``load`` (they wait for the whole pending save);
- explicit ``future.wait_for_staging()`` (or ``CheckpointManager.wait_for_staging()``), which
  the caller owes before any other in-place update (a buffer updated in forward, an EMA,
  ``param.add_()``).

A staging error is raised by ``wait_for_staging()`` and the Future, and once by the next
hooked ``optimizer.step()``; the write then fails too and its staging directory is removed.
"""

from __future__ import annotations

import concurrent.futures
import threading
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, runtime_checkable

import torch

from hyper_parallel.core.distributed_checkpoint.host_memory.staging_buffers import process_staging_buffers
from hyper_parallel.core.distributed_checkpoint.host_memory.snapshot import StagedSave


@runtime_checkable
class WrapsOptimizer(Protocol):
    """A Stateful wrapper of one optimizer (e.g. ``OptimizerState``): ``optim`` is guarded."""

    optim: torch.optim.Optimizer


def optimizers_in(stateful: Dict[str, Any]) -> List[torch.optim.Optimizer]:
    """The optimizers among a state dict's top-level Stateful values (see the Note)."""
    found = []
    for value in stateful.values():
        if isinstance(value, torch.optim.Optimizer):
            found.append(value)
        elif isinstance(value, WrapsOptimizer) and isinstance(value.optim, torch.optim.Optimizer):
            found.append(value.optim)
    return found


class AsyncSaveFuture(concurrent.futures.Future):
    """What ``async_save`` returns: a Future of the committed ``Metadata`` (or of the error),
    plus ``staging_completion``, a Future resolved once the state at the call is staged
    (already resolved when ``async_save`` returns, unless it stages in the background)."""

    def __init__(self, staging_completion: concurrent.futures.Future) -> None:
        super().__init__()
        self.staging_completion = staging_completion

    def wait_for_staging(self, timeout: Optional[float] = None) -> None:
        """Block until the state is staged: after this, in-place updates cannot reach the
        checkpoint.

        Raises:
            what staging raised (the save then fails too); TimeoutError after ``timeout`` s.
        """
        self.staging_completion.result(timeout)


def _resolve(target: concurrent.futures.Future, source: concurrent.futures.Future) -> None:
    """Give ``target`` the outcome of the finished ``source``."""
    error = source.exception()
    if error is None:
        target.set_result(source.result())
    else:
        target.set_exception(error)


class AsyncSaver:
    """Runs saves' staging and writes on two background threads, one save at a time, fed by
    the snapshot's copy stages (snapshot.py) from reusable buffers. Callers wait for the previous
    save (:meth:`wait`) before planning the next one."""

    def __init__(self) -> None:
        self.staging = process_staging_buffers()
        self._lock = threading.Lock()
        self._pending: Optional[concurrent.futures.Future] = None  # the last save, until done
        self._staging: Optional[concurrent.futures.Future] = None  # its background staging, until reported
        self._executors: Dict[str, concurrent.futures.ThreadPoolExecutor] = {}
        self._guarded: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()

    def wait(self) -> None:
        """Block until the last save has finished (errors are left to its Future)."""
        with self._lock:
            pending = self._pending
        if pending is not None:
            concurrent.futures.wait([pending])

    def wait_for_staging(self) -> None:
        """Block until the last save's state is staged (the optimizer hook).

        Raises:
            what that staging raised, the first time it is reported.
        """
        with self._lock:
            staging = self._staging
        if staging is None:
            return
        concurrent.futures.wait([staging])
        with self._lock:
            if self._staging is staging:
                self._staging = None
        staging.result()

    def guard(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        """Make every ``optimizer.step()`` wait for pending staging first (one pre-hook per
        optimizer, installed on first use and kept)."""
        for optimizer in optimizers:
            if optimizer not in self._guarded:
                optimizer.register_step_pre_hook(self._before_step)
                self._guarded.add(optimizer)

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.wait_for_staging()

    def start(self, write: Callable[[], Any], staged: StagedSave, *, background: bool) -> AsyncSaveFuture:
        """Stage ``staged`` and run ``write`` (which consumes it) on the write thread: staging
        in the caller (returns once staged; raises what staging raised) or, with
        ``background``, on the staging thread (returns at once)."""
        staging: concurrent.futures.Future = concurrent.futures.Future()
        staging.set_running_or_notify_cancel()
        future = AsyncSaveFuture(staging)
        future.set_running_or_notify_cancel()
        if not background:
            written = self.write_while_staging(write, staged)
            staging.set_result(None)
            written.add_done_callback(lambda done: _resolve(future, done))
            with self._lock:
                self._pending, self._staging = future, None  # an unreported older error is stale now
            return future
        with self._lock:
            self._pending, self._staging = future, staging
        self._executor("stage").submit(self._stage_then_write, write, staged, future)
        return future

    def _stage_then_write(self, write: Callable[[], Any], staged: StagedSave, future: AsyncSaveFuture) -> None:
        try:
            written = self.write_while_staging(write, staged)
        except BaseException as exc:  # the write has failed with it and cleaned up
            future.staging_completion.set_exception(exc)
            future.set_exception(exc)
            return
        future.staging_completion.set_result(None)
        written.add_done_callback(lambda done: _resolve(future, done))

    def _executor(self, role: str) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if role not in self._executors:
                self._executors[role] = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix=f"hyper_parallel-async-{role}")
            return self._executors[role]

    def write_while_staging(self, write: Callable[[], Any], staged: StagedSave) -> concurrent.futures.Future:
        """Stage every chunk of ``staged`` from this thread and run ``write`` (which consumes
        them) on the write thread; returns the write's Future once all is staged.

        A synchronous save's write starts at once. A snapshot's (async save) starts when the
        staging window first fills (it then drains it while the next chunks are copied), else
        right after staging, so that staging does not share the CPU with writing.

        Raises:
            what staging raised, once the write (which fails with it) has stopped.
        """
        started: List[concurrent.futures.Future] = []

        def start() -> None:
            if not started:
                started.append(self._executor("write").submit(write))

        if not staged.snapshot:
            start()
        try:
            staged.produce(start)
        except BaseException:
            start()  # the write fails on the staging error too (an async one tells the other ranks)
            concurrent.futures.wait(started)
            raise
        start()
        return started[0]
