"""The background side of ``async_save``: one save in flight per owner, its thread and buffers."""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable, Optional

from hyper_parallel.core.distributed_checkpoint.staging import StagingBuffers


class AsyncSaver:
    """Runs async saves' writes on one background thread, one at a time, from reusable
    staging buffers. Callers wait for the previous save (:meth:`wait`) before staging the
    next one, so the buffers are never overwritten while being written."""

    def __init__(self) -> None:
        self.staging = StagingBuffers()
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
