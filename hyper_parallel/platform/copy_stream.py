"""Host <-> device copies on a side stream, so that they overlap compute and file I/O.

On CPU there is no stream: every call runs synchronously and events are None, so code
written against :class:`CopyStream` behaves the same everywhere and CPU tests exercise the
accelerator code path.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from hyper_parallel.platform.platform import Platform


class CopyStream:
    """A side stream of ``platform``'s accelerator ``device`` for asynchronous copies (none
    on CPU).

    The current device and the current stream are per host thread: build it in the thread
    whose work it is ordered against (:meth:`after_current_work`, :meth:`make_current_wait`
    use the calling thread's current stream of ``device``), with ``device`` taken there
    (``platform.current_device()``). Copies issued under :meth:`active` run on it from any
    thread, as long as the accelerator tensors they touch are on ``device`` (:meth:`serves`).
    """

    def __init__(self, platform: Platform, device: torch.device) -> None:
        self._module = platform.device_module
        self.device = device
        self._stream = self._module.Stream(device=device) if self._module is not None else None

    def serves(self, tensor: torch.Tensor) -> bool:
        """Whether copies of ``tensor`` under :meth:`active` run on this stream (or need none):
        False only for memory of another device of this stream's accelerator."""
        return tensor.device.type != self.device.type or tensor.device == self.device

    def after_current_work(self) -> None:
        """Order later copies on this stream after the work already queued on the calling
        thread's current stream of the device (which produces the data they read)."""
        if self._stream is not None:
            self._stream.wait_stream(self._module.current_stream(self.device))

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the enclosed (``non_blocking``) copies on this stream (made the current stream
        of its device inside the block)."""
        if self._stream is None:
            yield
            return
        with self._module.stream(self._stream):
            yield

    def record(self) -> Optional[Any]:
        """An event marking the copies issued so far on this stream (None on CPU: done). A
        blocking-sync event: a host thread waiting for it (:func:`wait_event`) sleeps instead
        of spinning a core."""
        if self._stream is None:
            return None
        event = self._module.Event(blocking=True)
        event.record(self._stream)
        return event

    def make_current_wait(self) -> None:
        """Order the calling thread's later work on the device's current stream after this
        stream's copies (loads)."""
        if self._stream is not None:
            self._module.current_stream(self.device).wait_stream(self._stream)


def wait_event(event: Optional[Any]) -> None:
    """Block the calling thread until ``event`` (from :meth:`CopyStream.record`) completed."""
    if event is not None:
        event.synchronize()


def event_done(event: Optional[Any]) -> bool:
    """Whether ``event`` completed, without blocking."""
    return event is None or bool(event.query())
