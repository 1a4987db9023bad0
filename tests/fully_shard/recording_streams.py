"""A Streams implementation that records every stream operation, for tests of stream order."""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Dict, List, Optional

import torch

from hyper_parallel.platform import Streams


class RecordingStreams(Streams):
    """Logs every operation with the stream current at the time ("compute" outside use()).
    An event is ``("event", <stream>, <its record's index in the log + 1>)``; ``waited`` maps
    the log index of each ``wait_event`` to the event waited for."""

    all_gather = "all_gather"
    reduce_scatter = "reduce_scatter"
    all_reduce = "all_reduce"
    async_collectives = False  # as on accelerators

    def __init__(self):
        self.current = "compute"
        self.log: List[tuple] = []
        self.waited: Dict[int, Any] = {}

    @contextlib.contextmanager
    def _use(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def use(self, stream: Any) -> ContextManager[None]:
        return self._use(stream)

    def wait_for_current(self, stream: Any) -> None:
        self.log.append(("wait_for_current", stream, self.current))

    def record_event(self) -> Optional[Any]:
        self.log.append(("record_event", self.current))
        return ("event", self.current, len(self.log))

    def wait_event(self, event: Optional[Any]) -> None:
        self.waited[len(self.log)] = event
        self.log.append(("wait_event", event[1] if event else None, self.current))

    def record_host_event(self) -> Optional[Any]:
        self.log.append(("record_host_event", self.current))
        return ("host event", self.current, len(self.log))

    def synchronize(self, event: Optional[Any]) -> None:
        self.log.append(("synchronize", event[1] if event else None))

    def free_after_use(self, tensor: torch.Tensor, stream: Any) -> None:
        self.log.append(("free_after_use", stream, self.current))

    def reclaim(self, stream: Any) -> None:
        self.log.append(("reclaim", stream, self.current))
