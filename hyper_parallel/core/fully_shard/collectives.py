"""The only place that calls torch.distributed collectives for fully_shard.

Every call is counted (``collective_counts``) so tests can check that a parameter group issues
one all-gather / reduce-scatter / all-reduce per pass, and so are the bytes each rank puts in
(``collective_bytes``, by collective and dtype: e.g. float8 weights gathered as ``uint8``);
:func:`profiler_label` names the profiler ranges around them.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import Counter
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from hyper_parallel import _torch_compat as compat

_COUNTS: Counter = Counter()
_BYTES: Counter = Counter()
# A custom all-gather (torch's ``AllGather`` protocol, ``FSDPModule.set_custom_all_gather``) of
# the group issuing its gathers now; per context, so that thread-simulated ranks do not mix.
_ALL_GATHER_COMM: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar("all_gather_comm", default=None)
# The torch.distributed functions are looked up at call time (not bound at import) so that
# instrumentation patching them (e.g. torch.testing's patch_all_gather) sees these calls.


def collective_counts() -> Dict[str, int]:
    """Number of collectives issued by fully_shard in this process since the last reset."""
    return dict(_COUNTS)


def collective_bytes() -> Dict[Tuple[str, torch.dtype], int]:
    """Bytes this rank passed into fully_shard's collectives since the last reset, by
    (collective, dtype)."""
    return dict(_BYTES)


def reset_collective_counts() -> None:
    _COUNTS.clear()
    _BYTES.clear()


def _count(name: str, tensor: torch.Tensor) -> None:
    _COUNTS[name] += 1
    _BYTES[(name, tensor.dtype)] += tensor.numel() * tensor.element_size()


def profiler_label(name: str, module_fqn: str) -> str:
    """``hp::<name>``, followed by the modules' qualified names where there are any (the
    root's are empty), as FSDP2 labels its ranges (``FSDP::all_gather (layers.0)``)."""
    return f"hp::{name} ({module_fqn})" if module_fqn else f"hp::{name}"


@contextlib.contextmanager
def custom_all_gather(comm: Optional[Any]) -> Iterator[None]:
    """:func:`all_gather` calls inside run ``comm(output, input, group, async_op)`` (None: torch's)."""
    token = _ALL_GATHER_COMM.set(comm)
    try:
        yield
    finally:
        _ALL_GATHER_COMM.reset(token)


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup,
               async_op: bool) -> Optional[dist.Work]:
    """Gather every rank's flat ``shard`` into the flat ``output`` (rank-major)."""
    _count("all_gather", shard)
    comm = _ALL_GATHER_COMM.get()
    if comm is not None:
        return comm(output, shard, group, async_op)
    return compat.all_gather_single(output, shard, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup,
                   async_op: bool, comm: Optional[Any] = None) -> Optional[dist.Work]:
    """Sum the flat ``full`` (rank-major chunks) over ``group``; this rank's chunk into ``output``
    (through ``comm(output, input, group, op, async_op)``: torch's ``ReduceScatter`` protocol)."""
    _count("reduce_scatter", full)
    if comm is not None:
        return comm(output, full, group, dist.ReduceOp.SUM, async_op)
    return compat.reduce_scatter_single(output, full, op=dist.ReduceOp.SUM, group=group,
                                      async_op=async_op)


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool) -> Optional[dist.Work]:
    """Sum ``tensor`` in place over ``group``."""
    _count("all_reduce", tensor)
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
