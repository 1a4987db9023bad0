"""The background side of saves: one write in flight per owner, its thread and staging buffers."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, List, Optional

from hyper_parallel.core.distributed_checkpoint.staging import StagedSave, process_staging_buffers


class AsyncSaver:
    """Runs saves' writes on one background thread, one at a time, fed by the staging
    pipeline (staging.py) from reusable buffers. Callers wait for the previous save
    (:meth:`wait`) before staging the next one."""

    def __init__(self) -> None:
        self.staging = process_staging_buffers()
        self._lock = threading.Lock()
        self._pending: Optional[concurrent.futures.Future] = None
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None

    def wait(self) -> None:
        """Block until the last submitted write has finished (errors are left to its Future)."""
        with self._lock:
            pending = self._pending
        if pending is not None:
            concurrent.futures.wait([pending])

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on the background thread; returns its Future."""
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="hyper_parallel-async-save")
            self._pending = self._executor.submit(fn, *args)
            return self._pending

    def write_while_staging(self, write: Callable[[], Any], staged: StagedSave) -> concurrent.futures.Future:
        """Stage every chunk of ``staged`` from this thread and run ``write`` (which consumes
        them) on the background thread; returns the write's Future once all is staged.

        A synchronous save's write starts at once. A snapshot's (async save) starts when the
        staging window first fills (it then drains it while the next chunks are copied), else
        right after staging, so that ``async_save`` does not share the CPU between copying and
        writing before it returns.

        Raises:
            what staging raised, once the write (which fails with it) has stopped.
        """
        started: List[concurrent.futures.Future] = []

        def start() -> None:
            if not started:
                started.append(self.submit(write))

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
