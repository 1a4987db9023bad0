"""The process's staging buffers: a pool of host memory in fixed-size slabs (pinned on
accelerators; ``hdcp.staging_buffers()``) allocated on
first use, lent to saves (snapshot.py) and loads (bounce.py) within a window each, reused
across them, and released on request: a released slab's pages are unlocked and given back
to the system (``Platform.pinned_host_buffer``); where they came from the caching host
allocator (NPU), that cache is emptied once they are dropped.
"""

from __future__ import annotations

import threading
from typing import Callable, List, Optional, Tuple

import torch

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.platform import get_platform
from hyper_parallel.platform.copy_stream import CopyStream

DEFAULT_SLAB_BYTES = 32 << 20
DEFAULT_SYNC_WINDOW_BYTES = 256 << 20


class Slab:
    """One host buffer of the pool: ``used`` bytes handed out, ``pending`` pieces not yet
    consumed (a save's bookkeeping; loads track their copies themselves)."""

    def __init__(self, nbytes: int) -> None:
        self.buffer = get_platform().pinned_host_buffer(nbytes)
        self.used = 0
        self.pending = 0


class SlabWindow:
    """The slabs one save (or load) holds, at most ``limit`` of them (None: no limit)."""

    def __init__(self, limit: Optional[int]) -> None:
        self.limit, self.held = limit, 0
        self.error: Optional[BaseException] = None


class StagingBuffers:
    """The process's staging buffers: host slabs allocated on first use and reused by later saves
    and loads; :meth:`release` gives the memory back.

    Args:
        slab_bytes: size of one slab (the unit of allocation and of copy/write overlap).
        budget_bytes: most host memory the slabs may take; None: what an async save of the
            whole state needs (an async save larger than the budget blocks until the excess
            has been written).
        sync_window_bytes: most slab memory a synchronous save or a load uses at once.
    """

    def __init__(self, *, slab_bytes: int = DEFAULT_SLAB_BYTES, budget_bytes: Optional[int] = None,
                 sync_window_bytes: int = DEFAULT_SYNC_WINDOW_BYTES) -> None:
        self._cond = threading.Condition()
        self._free: List[Slab] = []
        self._allocated = 0  # slabs alive (free or held)
        self.allocations = 0
        self.slab_bytes = slab_bytes
        self.configure(slab_bytes=slab_bytes, budget_bytes=budget_bytes, sync_window_bytes=sync_window_bytes)

    def configure(self, *, slab_bytes: int, budget_bytes: Optional[int], sync_window_bytes: int) -> None:
        """Set the sizes (see the class). Changing ``slab_bytes`` releases the free slabs.

        Raises:
            ValueError: ``slab_bytes < 1``, or a window or budget smaller than one slab.
        """
        if slab_bytes < 1 or sync_window_bytes < slab_bytes or (budget_bytes is not None and budget_bytes < slab_bytes):
            raise ValueError(f"staging sizes need 1 <= slab_bytes <= sync_window_bytes and slab_bytes <= "
                             f"budget_bytes; got slab_bytes={slab_bytes}, sync_window_bytes={sync_window_bytes}, "
                             f"budget_bytes={budget_bytes}")
        with self._cond:
            dropped = self._drop_free() if slab_bytes != self.slab_bytes else 0
            self.slab_bytes, self.budget_bytes, self.sync_window_bytes = slab_bytes, budget_bytes, sync_window_bytes
        return_host_memory(dropped)

    @property
    def nbytes(self) -> int:
        """Host memory the slabs hold now."""
        return self._allocated * self.slab_bytes

    @property
    def in_use(self) -> int:
        """Slabs a save or load holds now (0 between saves)."""
        with self._cond:
            return self._allocated - len(self._free)

    def release(self) -> None:
        """Free every slab not in use (call after the last save; the next one allocates again)
        and give its memory back to the system."""
        with self._cond:
            dropped = self._drop_free()
        return_host_memory(dropped)

    def _drop_free(self) -> int:
        """Under ``_cond``: drop the free slabs; returns how many."""
        dropped = len(self._free)
        self._allocated -= dropped
        self._free = []
        return dropped

    def window(self, snapshot: bool) -> SlabWindow:
        """A new save's or load's share: the whole budget for a snapshot, else the sync window."""
        if snapshot:
            limit = None if self.budget_bytes is None else self.budget_bytes // self.slab_bytes
        else:
            limit = self.sync_window_bytes // self.slab_bytes
            if self.budget_bytes is not None:
                limit = min(limit, self.budget_bytes // self.slab_bytes)
        return SlabWindow(limit)

    def acquire(self, window: SlabWindow, before_waiting: Callable[[], None]) -> Slab:
        """A slab for ``window``; blocks while the window or the budget is used up, after
        calling ``before_waiting()`` (which must start whatever frees slabs).

        Raises:
            the window's error, once it has one (the other side of the copy stages failed).
        """
        with self._cond:
            waited = False
            while True:
                claimed, slab = self._claim(window)
                if claimed:
                    break
                if not waited:
                    waited = True
                    self._cond.release()
                    try:
                        before_waiting()
                    finally:
                        self._cond.acquire()
                    continue
                self._cond.wait()
        return self._ready(window, slab)

    def try_acquire(self, window: SlabWindow) -> Optional[Slab]:
        """A slab for ``window`` if the window and the budget allow one now, else None (never
        blocks). Raises as :meth:`acquire`."""
        with self._cond:
            claimed, slab = self._claim(window)
        return self._ready(window, slab) if claimed else None

    def _claim(self, window: SlabWindow) -> Tuple[bool, Optional[Slab]]:
        """Under ``_cond``: count a slab for ``window`` if it may have one: (True, a free slab,
        or None: allocate one), else (False, None)."""
        if window.error is not None:
            raise window.error
        if window.limit is not None and window.held >= window.limit:
            return False, None
        if self._free:
            window.held += 1
            return True, self._free.pop()
        if self.budget_bytes is None or (self._allocated + 1) * self.slab_bytes <= self.budget_bytes:
            window.held += 1
            self._allocated += 1
            self.allocations += 1
            return True, None
        return False, None

    def _ready(self, window: SlabWindow, slab: Optional[Slab]) -> Slab:
        """A claimed slab, allocated now if ``slab`` is None, with nothing handed out."""
        if slab is None:
            try:
                slab = Slab(self.slab_bytes)
            except BaseException:
                with self._cond:
                    self._allocated -= 1
                    window.held -= 1
                raise
        slab.used = slab.pending = 0
        return slab

    def give_back(self, window: SlabWindow, slab: Slab) -> None:
        """Return ``slab`` (no piece of it still needed) to the pool."""
        with self._cond:
            window.held -= 1
            self._free.append(slab)
            self._cond.notify_all()

    def fail(self, window: SlabWindow, error: BaseException) -> None:
        """Wake whoever waits on ``window`` with ``error``."""
        with self._cond:
            if window.error is None:
                window.error = error
            self._cond.notify_all()


def return_host_memory(dropped: int) -> None:
    """After ``dropped`` pinned buffers (slabs, a load's buffers bigger than a slab) were
    dropped: where pinned buffers stay with the caching host allocator once dropped (NPU's
    ``pin_memory=True``), empty that cache, or dropping them would give nothing back."""
    platform = get_platform()
    if dropped and platform.pinned_memory_cached():
        platform.empty_host_cache()


def check_copy_device(stream: CopyStream, tensor: torch.Tensor, key: str) -> None:
    """Refuse to stage ``key``'s ``tensor`` through ``stream`` when it is on another device
    of the accelerator: its copy would run on that device's current stream, unordered with
    the events the copy stages wait on (silently wrong bytes).

    Raises:
        CheckpointError: naming ``key``, the tensor's device and the stream's device.
    """
    if not stream.serves(tensor):
        raise CheckpointError(
            f"{key!r} is on {tensor.device}, but checkpoint copies run on a stream of the current "
            f"device, {stream.device}: set the current device to {tensor.device} before saving or "
            f"loading, or move the tensor to {stream.device}"
        )


_PROCESS_BUFFERS = StagingBuffers()


def process_staging_buffers() -> StagingBuffers:
    """The pool this process's saves and loads share (``hdcp.staging_buffers()``)."""
    return _PROCESS_BUFFERS
