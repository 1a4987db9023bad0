"""The ``FSDPModule`` methods of torch's FSDP2 beyond hyper_parallel's core set, on our state.

:class:`TorchFSDPMethods` is a base of :class:`~hyper_parallel.core.fully_shard.FSDPModule`,
which is itself a subclass of torch's ``torch.distributed.fsdp.FSDPModule`` (so that programs
testing ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` apply their settings to our
modules). Torch's methods must never run on our state: every public method torch's class
defines is defined here or in ``module_api.FSDPModule`` (``tests/fully_shard/test_torch_fsdp_module.py``
checks it), and one a newer torch adds is refused in one line by
:func:`refuse_unknown_torch_methods`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, List, Optional

from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from hyper_parallel._torch_compat import current_graph_task_id


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")


class GradientReductionHandle:
    """Returned by ``finalize_backward(async_op=True)``: ``wait()`` finishes the reductions,
    sets the sharded gradients and reshards."""

    def __init__(self, finish: Optional[Callable[[], None]]):
        self._finish = finish

    def wait(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()


class TorchFSDPMethods:
    """torch FSDP2's ``FSDPModule`` methods that hyper_parallel's core API does not need
    itself: implemented on our state, or refused in one line where the feature needs CUDA
    (NCCL allocators, symmetric memory, CUDA graphs)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # torch's FSDPModule.__new__ builds the unwrapped class instead (and re-runs __init__);
        # ours skips it: construction stays what it was before this class derived from torch's.
        create = super(TorchFSDPModule, cls).__new__
        return create(cls) if create is object.__new__ else create(cls, *args, **kwargs)

    # -- reduction -------------------------------------------------------------------------
    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """torch's older name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for torch compatibility: hyper_parallel's reductions always use
        ``ReduceOp.SUM`` (the gradient divide factor is applied before and after the
        collective), so the gradients are averaged (or divided by the custom factor) either way.

        Raises:
            ValueError: ``enable`` is not a bool.
        """
        _check_bool("enable", enable)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Accepted for torch compatibility: hyper_parallel always reduce-scatters every trainable
        parameter (zeros where a rank has no gradient, with a presence flag per parameter), so
        ranks that used different parameters issue the same collectives either way.

        Raises:
            ValueError: the value is not a bool.
        """
        _check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """hyper_parallel keeps one group's reduce-scatter per stage in flight, i.e. torch's
        default of one input buffer; only ``1`` is accepted.

        Raises:
            TypeError: not an int. ValueError: not 1.
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers != 1:
            raise ValueError(f"set_reduce_scatter_max_input_buffers({max_input_buffers}) is not supported by "
                             "hyper_parallel.fully_shard: one reduce-scatter input is in flight per group (1)")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """``True``: reduce-scatter over a process group of its own (same ranks as the shard
        group of each mesh, one per distinct rank set), so it can progress alongside the all-gathers;
        ``False``: over the shard group again. Collective over the world: every rank calls it,
        with the same modules (each creates the groups of every rank's meshes). *recurse*"""
        _check_bool("enable", enable)
        for sub in (sub for state in self._states(recurse) for sub in state.group.meshes):
            sub.reduce_scatter_group = sub.dp.separate_shard_group() if enable else sub.dp.shard_group

    # -- custom collectives ----------------------------------------------------------------
    def set_custom_all_gather(self, comm: Any) -> None:
        """Run this group's all-gathers through ``comm`` (torch's ``AllGather`` protocol:
        ``comm(output, input, group, async_op) -> Work | None``) instead of
        ``torch.distributed.all_gather_single``. Buffers are allocated by hyper_parallel (the
        comm's ``allocate`` is not called)."""
        self._state.group.all_gather_comm = _callable_comm("set_custom_all_gather", comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Run this group's reduce-scatters through ``comm`` (torch's ``ReduceScatter``
        protocol: ``comm(output, input, group, op, async_op) -> Work | None``; ``op`` is always
        ``ReduceOp.SUM``). Buffers are allocated by hyper_parallel (``allocate`` is not called)."""
        self._state.group.reduce_scatter_comm = _callable_comm("set_custom_reduce_scatter", comm)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Only ``False`` (the default): allocating communication buffers from the process
        group's allocator (NCCL) is not supported.

        Raises:
            ValueError: ``enable`` is True or not a bool.
        """
        _check_bool("enable", enable)
        if enable:
            raise ValueError("set_allocate_memory_from_process_group_for_comm(True) is not supported by "
                             "hyper_parallel.fully_shard (an NCCL allocator feature)")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Not supported: symmetric-memory all-gathers are a CUDA/NCCL feature.

        Raises:
            ValueError: always.
        """
        raise ValueError(f"set_symm_mem_for_comm({backend!r}) is not supported by hyper_parallel.fully_shard "
                         "(CUDA symmetric memory)")

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Only ``False`` (the default): the unsharded storage is freed at reshard; keeping it
        (for CUDA graph capture) is not supported.

        Raises:
            ValueError: ``keep`` is True or not a bool.
        """
        _check_bool("keep", keep)
        if keep:
            raise ValueError("set_keep_unsharded_storage(True) is not supported by hyper_parallel.fully_shard: "
                             "the unsharded storage is freed at reshard")

    # -- manual backward finalization (torch's pipelining) ----------------------------------
    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """``True``: the end of backward leaves the gradient reductions to
        :meth:`finalize_backward` (and supersedes :meth:`set_is_last_backward`). Call on the
        root, before backward.

        Raises:
            ValueError: not a bool. RuntimeError: not the root, or called during backward.
        """
        _check_bool("enabled", enabled)
        state = self._state
        if state.ctx is not None and not state.is_root:
            raise RuntimeError("set_manual_backward_finalization must be called on the root fully_shard module")
        if enabled != state.manual_finalization and current_graph_task_id() != -1:
            raise RuntimeError("set_manual_backward_finalization cannot change mode during backward")
        state.set_manual_finalization(enabled)

    def finalize_backward(self, *, async_op: bool = False) -> Optional[GradientReductionHandle]:
        """After the backwards of one logical step (with gradient sync re-enabled before this
        call): reduce the gradients they left unreduced, wait for every reduction, set the
        sharded gradients and reshard per ``reshard_after_backward``. ``async_op``: issue the
        reductions and return a handle whose ``wait()`` does the rest. Before the root's first
        forward it does nothing.

        Raises:
            RuntimeError: not the root module.
        """
        state = self._state
        ctx = state.ctx
        if ctx is None:
            return GradientReductionHandle(None) if async_op else None
        if not state.is_root:
            raise RuntimeError("finalize_backward must be called on the root fully_shard module")
        for owner in ctx.states:
            if owner.group.requires_gradient_sync and owner.group.has_unreduced_grads():
                ctx.advance_reductions()  # at most one group per stage in flight, as in backward
                owner.group.reduce_grads()
                ctx.reducing.append(owner.group)

        def finish() -> None:
            ctx.finish_reductions()
            ctx.finish_backward()

        if async_op:
            return GradientReductionHandle(finish)
        finish()
        return None

    # -- torch internals ---------------------------------------------------------------------
    def _get_fsdp_state(self) -> Any:
        raise RuntimeError(f"{type(self).__name__} was wrapped by hyper_parallel.fully_shard: it has no torch "
                           "FSDPState (torch-internal code cannot drive it)")

    def _set_unshard_async_op(self, async_op: bool) -> None:
        raise RuntimeError("_set_unshard_async_op (torch-internal) is not supported by hyper_parallel.fully_shard")


def _callable_comm(method: str, comm: Any) -> Any:
    if not callable(comm):
        raise TypeError(f"{method} takes a callable comm (torch's AllGather/ReduceScatter protocol), "
                        f"got {type(comm).__name__}")
    return comm


def torch_public_methods() -> List[str]:
    """The public methods torch's ``FSDPModule`` defines (this torch version)."""
    return sorted(name for name, value in vars(TorchFSDPModule).items()
                  if not name.startswith("_") and inspect.isfunction(value))


def refuse_unknown_torch_methods(cls: type) -> None:
    """Give ``cls`` (a subclass of torch's ``FSDPModule``) a one-line refusal for each public
    method of torch's class that ``cls`` does not define itself (a newer torch's additions), so
    that torch's implementation never runs on hyper_parallel's state."""
    for name in torch_public_methods():
        if getattr(cls, name) is getattr(TorchFSDPModule, name):
            setattr(cls, name, _refusal(name))


def _refusal(name: str) -> Callable[..., None]:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"FSDPModule.{name} (torch's) is not supported by hyper_parallel.fully_shard")

    refuse.__name__ = name
    return refuse
