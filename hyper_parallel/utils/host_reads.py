"""Count the places a program reads a tensor's values on the host: on an accelerator each is a
device-to-host sync (the host waits for the device), on CPU it is free, so CPU tests count them
with this to keep a step's syncs from growing unseen."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

from hyper_parallel._torch_compat import HOST_READING_OPS, TorchDispatchMode

__all__ = ["counted_host_reads"]

# The aten ops that read values on the host (HOST_READING_OPS) and the Python methods that do (``tolist`` reads the memory below the dispatcher).
_READING_METHODS = frozenset({"tolist", "item", "__bool__", "__int__", "__float__", "__index__"})


class _OpCounter(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READING_OPS:
            self.counts[str(func)] += 1
        elif func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.counts[str(func)] += 1  # sizes its output from the repeats' sum
        elif func is torch.ops.aten.index.Tensor and any(
                i is not None and i.dtype == torch.bool for i in args[1]):
            self.counts["boolean index"] += 1  # sizes its output from the mask's count
        return func(*args, **kwargs)


class _MethodCounter(TorchFunctionMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None)
        if name in _READING_METHODS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counted_host_reads() -> Iterator[Counter]:
    """A ``Counter`` of the host reads of tensor values inside the block, by op or method
    (``tolist``, ``item``, ``__bool__``, ``aten.nonzero``, ``aten.bincount``, a boolean index,
    ``repeat_interleave`` without ``output_size``, ...), on any device."""
    counts: Counter = Counter()
    with _MethodCounter(counts), _OpCounter(counts):
        yield counts
