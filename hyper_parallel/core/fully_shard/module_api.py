"""FSDPModule: the methods every module passed to ``fully_shard`` gains, and
``register_fsdp_forward_method``."""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, List, Optional

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from hyper_parallel.core.fully_shard.in_flight import UnshardHandle
from hyper_parallel.core.fully_shard.state import HSDPState
from hyper_parallel.core.fully_shard.torch_methods import TorchFSDPMethods, _check_bool, refuse_unknown_torch_methods


class FSDPModule(TorchFSDPMethods, TorchFSDPModule):
    """Mixin added to the class of every module passed to :func:`fully_shard`.

    A subclass of torch's ``torch.distributed.fsdp.FSDPModule``: code written for torch's
    FSDP2 that tests ``isinstance(module, FSDPModule)`` with torch's class (torchtitan,
    accelerate, torch's pipelining) applies its settings to our modules. Every method torch's
    class defines is overridden (here and in :class:`TorchFSDPMethods`), so torch's
    implementation never runs on our state.

    Setters marked *recurse* apply to every ``fully_shard`` module in the subtree by default
    (``recurse=False``: this module's group only); the others apply to this module's group.
    """

    @property
    def _state(self) -> HSDPState:
        return self.__dict__["_hsdp_state"]

    def _states(self, recurse: bool) -> List[HSDPState]:
        if not recurse:
            return [self._state]
        states = [m.__dict__["_hsdp_state"] for m in self.modules() if "_hsdp_state" in m.__dict__]
        return list(dict.fromkeys(states))  # one state per fully_shard([a, b]) call

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gather this module's parameters; with ``async_op`` return a handle whose
        ``wait()`` completes it (the next forward waits anyway). Not recursive."""
        state = self._state
        if state.ctx is None:
            state.group.lazy_init()
        return state.group.unshard(async_op=async_op)

    def reshard(self) -> None:
        """Free the unsharded parameters; the module holds its sharded DTensors again.
        Not recursive."""
        self._state.group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward accumulates unsharded gradients locally without any reduction
        (gradient accumulation); the next backward with True reduces the sum. *recurse*"""
        for state in self._states(recurse):
            state.group.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters but keeps the result as a partial sum instead of
        all-reducing over the replicate dim; the next all-reduce includes it. *recurse*"""
        for state in self._states(recurse):
            state.group.requires_all_reduce = requires_all_reduce

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """False keeps the parameters unsharded after backward (saves the next forward's
        all-gather, e.g. between gradient-accumulation micro-batches). *recurse*"""
        for state in self._states(recurse):
            state.group.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` at run time (e.g. True on the root, whose default
        is False, or False for evaluation). Overrides the root default and any int given to
        ``fully_shard``. *recurse*

        Raises:
            ValueError: ``reshard_after_forward`` is not a bool.
        """
        _check_bool("reshard_after_forward", reshard_after_forward)
        for state in self._states(recurse):
            state.set_reshard_after_forward(reshard_after_forward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: do not all-gather this group before its backward, for groups whose backward
        does not read the parameter values (e.g. an embedding's weight gradient needs only
        the indices). Their gradients are still reduced."""
        _check_bool("unshard_in_backward", unshard_in_backward)
        self._state.unshard_in_backward = unshard_in_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the reduced gradients by ``factor`` instead of the data-parallel world size
        (``1.0``: sum over ranks). Applies to this module's group.

        Raises:
            ValueError: ``factor`` is not a positive number.
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"gradient divide factor must be a positive number, got {factor!r}")
        self._state.group.set_gradient_divide_factor(float(factor))

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """False: the next backward leaves its last reductions in flight (they overlap the
        next forward and finish in the next backward) instead of waiting for them at its end.
        Set True before the backward after which the gradients are read (optimizer step)."""
        _check_bool("is_last_backward", is_last_backward)
        self._state.set_is_last_backward(is_last_backward)

    def set_post_optim_event(self, event: Any) -> None:
        """Order the next step's all-gathers after ``event`` instead of after everything queued
        on the current stream. By default the root's pre-forward makes the all-gather stream
        wait for the current stream, so that the optimizer step has written the shards; work
        queued after the optimizer step that the parameters do not depend on is then a false
        dependency. Record an event right after ``optimizer.step()`` and pass it here; it is
        used by the next forward only, so set a new one every step. On CPU streams are in
        order and the event changes nothing.

        Args:
            event: a ``torch.Event`` (or the device module's ``Event``) recorded after the
                optimizer step.
        """
        self._state.set_post_optim_event(event)

    def reset_iter_state(self) -> None:
        """Recover after an exception in forward or backward: wait for and discard the
        collectives in flight, drop the failed step's gradients that are not yet reduced
        (and any ``set_requires_gradient_sync(False)`` / HSDP partial sums), reshard every
        group and clear the step state. Call it on the root module, then ``zero_grad`` and
        train on.

        Raises:
            RuntimeError: called on a module that is not the root.
        """
        self._state.reset_iter_state()

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Optional[Any] = None) -> None:
        """Call ``hook(grad)`` on this module's group's reduced gradient before it becomes the
        sharded ``.grad``: a flat tensor in the reduce dtype (this rank's shards, padded), after
        the reduce-scatter (FSDP) or after the replicate all-reduce (HSDP), already divided by
        the gradient divide factor. Modify it in place, e.g. all-reduce it over a group of your
        own. Not recursive; with HSDP ``requires_all_reduce=False`` it does not run.

        Args:
            hook: ``hook(reduce_output: torch.Tensor) -> None``.
            stream: accelerator stream to run the hook on (FSDP only; default: the
                all-reduce stream).

        Raises:
            ValueError: ``stream`` given with HSDP.
        """
        self._state.group.set_all_reduce_hook(hook, stream)

    def set_modules_to_forward_prefetch(self, modules: List["FSDPModule"]) -> None:
        """Start these modules' all-gathers when this module's forward starts (replaces the
        implicit next-module prefetch)."""
        self._state.forward_prefetch = _states_of(modules)

    def set_modules_to_backward_prefetch(self, modules: List["FSDPModule"]) -> None:
        """Start these modules' all-gathers when this module's backward starts (replaces the
        implicit previous-module prefetch)."""
        self._state.backward_prefetch = _states_of(modules)

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # .to() / .double() / to_empty() convert the registered parameters: make those the
        # sharded ones; the group re-binds its buffers to the new tensors at the next unshard.
        self.reshard()
        return super(TorchFSDPModule, self)._apply(*args, **kwargs)  # nn.Module's, never torch FSDP's


refuse_unknown_torch_methods(FSDPModule)
HSDPModule = FSDPModule


def _states_of(modules: Iterable[nn.Module]) -> List[HSDPState]:
    states = []
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"prefetch targets must be fully_shard modules, got {type(module).__name__}")
        states.append(module._state)
    return states


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (e.g. ``generate``) run like ``forward``: parameters
    unsharded before it, resharded after it (per ``reshard_after_forward``), backward hooks
    on its outputs. A no-op for modules that are not :class:`FSDPModule` (so the same code
    runs with and without ``fully_shard``).

    Raises:
        ValueError: ``module`` has no method ``method_name``.
    """
    if not isinstance(module, FSDPModule):
        return
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    state = module._state

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward_hook(module, args, kwargs)
        return state.post_forward_hook(module, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped)
