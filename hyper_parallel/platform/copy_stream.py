"""Host <-> device copies on a side stream, so that they overlap compute and file I/O.

The CPU/accelerator split is the one of ``streams.py``: a contract (:class:`CopyOps`) with a
CPU implementation on which every operation is a no-op and events are None (copies run
synchronously, so code written against :class:`CopyStream` behaves the same everywhere and
CPU tests exercise the accelerator code path) and one on the accelerator's device module,
chosen from the platform once.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Any, ContextManager, Optional

import torch

from hyper_parallel.platform.platform import Platform


class CopyOps(ABC):
    """The operations of one device's copy stream (see :class:`CopyStream`)."""

    @abstractmethod
    def after_current_work(self) -> None:
        """Order later copies on the stream after the calling thread's queued work."""

    @abstractmethod
    def active(self) -> ContextManager[None]:
        """Make the stream its device's current stream inside the ``with`` block."""

    @abstractmethod
    def record(self) -> Optional[Any]:
        """A blocking-sync event marking the copies issued so far (None: done)."""

    @abstractmethod
    def make_current_wait(self) -> None:
        """Order the calling thread's later work on the device after the stream's copies."""


class CpuCopyOps(CopyOps):
    """CPU: no stream; copies are synchronous, so nothing is left to order."""

    def after_current_work(self) -> None:
        pass

    def active(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def record(self) -> Optional[Any]:
        return None

    def make_current_wait(self) -> None:
        pass


class AcceleratorCopyOps(CopyOps):
    """A CUDA / NPU stream of ``device`` through the device module (``torch.cuda``, ``torch.npu``)."""

    def __init__(self, device_module: Any, device: torch.device) -> None:
        self._module, self._device = device_module, device
        self._stream = device_module.Stream(device=device)

    def after_current_work(self) -> None:
        self._stream.wait_stream(self._module.current_stream(self._device))

    def active(self) -> ContextManager[None]:
        return self._module.stream(self._stream)

    def record(self) -> Optional[Any]:
        event = self._module.Event(blocking=True)
        event.record(self._stream)
        return event

    def make_current_wait(self) -> None:
        self._module.current_stream(self._device).wait_stream(self._stream)


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
        self.device = device
        self._ops: CopyOps = (AcceleratorCopyOps(platform.device_module, device) if platform.is_accelerator
                              else CpuCopyOps())

    def serves(self, tensor: torch.Tensor) -> bool:
        """Whether copies of ``tensor`` under :meth:`active` run on this stream (or need none):
        False only for memory of another device of this stream's accelerator."""
        return tensor.device.type != self.device.type or tensor.device == self.device

    def after_current_work(self) -> None:
        """Order later copies on this stream after the work already queued on the calling
        thread's current stream of the device (which produces the data they read)."""
        self._ops.after_current_work()

    def active(self) -> ContextManager[None]:
        """Run the enclosed (``non_blocking``) copies on this stream (made the current stream
        of its device inside the block)."""
        return self._ops.active()

    def record(self) -> Optional[Any]:
        """An event marking the copies issued so far on this stream (None on CPU: done). A
        blocking-sync event: a host thread waiting for it (:func:`wait_event`) sleeps instead
        of spinning a core."""
        return self._ops.record()

    def make_current_wait(self) -> None:
        """Order the calling thread's later work on the device's current stream after this
        stream's copies (loads)."""
        self._ops.make_current_wait()


def wait_event(event: Optional[Any]) -> None:
    """Block the calling thread until ``event`` (from :meth:`CopyStream.record`) completed."""
    if event is not None:
        event.synchronize()


def event_done(event: Optional[Any]) -> bool:
    """Whether ``event`` completed, without blocking."""
    return event is None or bool(event.query())
