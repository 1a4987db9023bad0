"""Coordinator-centred steps: gather to rank 0, decide there, send back; errors reach every rank.

Traffic is O(world) at the coordinator and O(1) elsewhere (gather/scatter/broadcast, never
an all-gather of everyone's plans). Without a process group everything degenerates to
local calls on a world of one.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable, List, Optional

import torch.distributed as dist

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.utils.ranks import rank_and_world

_COORDINATOR = 0


class _Failure:
    """A step failed on ``rank``; carried between ranks instead of the (maybe unpicklable) error."""

    def __init__(self, step: str, rank: int, error: BaseException) -> None:
        self.message = f"{step} failed on rank {rank}: {type(error).__name__}: {error}"
        self.trace = "".join(traceback.format_exception(error))


class DistWrapper:
    """Runs checkpoint steps over the default process group (or alone when ``use_dist`` is False)."""

    def __init__(self, use_dist: bool) -> None:
        self.use_dist = use_dist
        self.rank, self.world_size = rank_and_world(use_dist)
        self.is_coordinator = self.rank == _COORDINATOR

    def gather(self, obj: Any) -> Optional[List[Any]]:
        if not self.use_dist:
            return [obj]
        out = [None] * self.world_size if self.is_coordinator else None
        dist.gather_object(obj, out, dst=_COORDINATOR)
        return out

    def scatter(self, objs: Optional[List[Any]]) -> Any:
        if not self.use_dist:
            return objs[0]
        out = [None]
        dist.scatter_object_list(out, objs if self.is_coordinator else None, src=_COORDINATOR)
        return out[0]

    def broadcast(self, obj: Any) -> Any:
        if not self.use_dist:
            return obj
        box = [obj if self.is_coordinator else None]
        dist.broadcast_object_list(box, src=_COORDINATOR)
        return box[0]

    def _run_local(self, step: str, local_fn: Callable[[], Any]):
        try:
            return local_fn(), None
        except Exception as exc:  # noqa: BLE001 - every rank must hear about it
            return _Failure(step, self.rank, exc), exc

    @staticmethod
    def _raise(result: Any, own_error: Optional[BaseException]) -> Any:
        if own_error is not None:
            raise own_error
        if isinstance(result, _Failure):
            raise CheckpointError(f"{result.message}\n--- traceback on that rank ---\n{result.trace}")
        return result

    def _global(self, step: str, gathered: List[Any], global_fn: Callable[[List[Any]], Any]):
        failure = next((g for g in gathered if isinstance(g, _Failure)), None)
        if failure is not None:
            return failure, None
        try:
            return global_fn(gathered), None
        except Exception as exc:  # noqa: BLE001
            return _Failure(step, self.rank, exc), exc

    def gather_then_scatter(self, step: str, local_fn: Callable[[], Any],
                            global_fn: Callable[[List[Any]], List[Any]]) -> Any:
        """``local_fn`` on every rank; the coordinator maps all results to one result per rank
        with ``global_fn``; each rank gets its own. A failure anywhere raises on every rank."""
        local, own_error = self._run_local(step, local_fn)
        gathered = self.gather(local)
        outgoing = None
        if self.is_coordinator:
            result, error = self._global(step, gathered, global_fn)
            own_error = own_error or error
            outgoing = [result] * self.world_size if isinstance(result, _Failure) else result
        return self._raise(self.scatter(outgoing), own_error)

    def gather_then_broadcast(self, step: str, local_fn: Callable[[], Any],
                              global_fn: Callable[[List[Any]], Any]) -> Any:
        """Like :meth:`gather_then_scatter`, but every rank gets the coordinator's one result."""
        local, own_error = self._run_local(step, local_fn)
        gathered = self.gather(local)
        result = None
        if self.is_coordinator:
            result, error = self._global(step, gathered, global_fn)
            own_error = own_error or error
        return self._raise(self.broadcast(result), own_error)

    def from_coordinator(self, step: str, fn: Callable[[], Any]) -> Any:
        """``fn`` on the coordinator only; its result (or failure) goes to every rank."""
        result, own_error = self._run_local(step, fn) if self.is_coordinator else (None, None)
        return self._raise(self.broadcast(result), own_error)
