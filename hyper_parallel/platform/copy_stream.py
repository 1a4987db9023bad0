"""Host <-> device copies on a side stream, so that they overlap compute and file I/O.

On CPU there is no stream: every call runs synchronously and events are None, so code
written against :class:`CopyStream` behaves the same everywhere and CPU tests exercise the
accelerator code path.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

from hyper_parallel.platform.platform import Platform


class CopyStream:
    """A side stream of ``platform``'s accelerator for asynchronous copies (none on CPU)."""

    def __init__(self, platform: Platform) -> None:
        self._module = platform.device_module
        self._stream = self._module.Stream() if self._module is not None else None

    def after_current_work(self) -> None:
        """Order later copies on this stream after the work already queued on the current
        stream (which produces the data they read)."""
        if self._stream is not None:
            self._stream.wait_stream(self._module.current_stream())

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the enclosed (``non_blocking``) copies on this stream."""
        if self._stream is None:
            yield
            return
        with self._module.stream(self._stream):
            yield

    def record(self) -> Optional[Any]:
        """An event marking the copies issued so far on this stream (None on CPU: done)."""
        if self._stream is None:
            return None
        event = self._module.Event()
        event.record(self._stream)
        return event

    def make_current_wait(self) -> None:
        """Order the current stream's later work after this stream's copies (loads)."""
        if self._stream is not None:
            self._module.current_stream().wait_stream(self._stream)


def wait_event(event: Optional[Any]) -> None:
    """Block the calling thread until ``event`` (from :meth:`CopyStream.record`) completed."""
    if event is not None:
        event.synchronize()


def event_done(event: Optional[Any]) -> bool:
    """Whether ``event`` completed, without blocking."""
    return event is None or bool(event.query())
