"""The torch-facing plumbing of fully_shard's hooks (``state.py``): the wrapper that keeps
them out of torch.compile graphs, the autograd node that marks one forward call's inputs,
and the test for running inside the autograd engine."""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch

from hyper_parallel._torch_compat import current_graph_task_id


def eager(hook: Callable) -> Callable:
    """``hook`` run eagerly, never traced by torch.compile: a compiled caller graph-breaks at
    it, and dynamo does not compile it as a frame of its own (it unshards, issues collectives
    and mutates module state, none of which belongs in a graph). Same approach as FSDP2."""
    return torch.compiler.disable(hook, recursive=True, reason="hyper_parallel fully_shard hook")


def in_backward() -> bool:
    """True while the autograd engine runs (e.g. checkpoint recomputation calls forward)."""
    return current_graph_task_id() != -1


class CallTracker(Protocol):
    """What :class:`FullyShardModuleInputs` reports to (``HSDPState``)."""

    def track_call(self, node: Any) -> None:
        """A forward call's node was created (forward)."""

    def input_grads_hook(self, node: Any) -> None:
        """The gradients w.r.t. that call's inputs are computed (backward)."""


class FullyShardModuleInputs(torch.autograd.Function):
    """Identity on one forward call's inputs that require grad; the node is the call's entry
    in its groups' ``GroupBackward.calls``, and its backward (once the gradients w.r.t. all
    those inputs are computed) reports it to the module's state. Being an autograd node, it
    runs before those gradients reach the hooks of the input tensors themselves (the previous
    module's pre-backward, registered on its outputs), so the module reduces and reshards
    before the previous one prefetches (FSDP2's post-backward point; see [Note: when a group
    reduces] in ``state.py``). Like FSDP2's, the outputs are views that the module's forward
    must not modify in place."""

    @staticmethod
    def forward(ctx: Any, state: CallTracker, *inputs: torch.Tensor) -> tuple:
        ctx.state = state
        state.track_call(ctx)  # this node is the call's
        ctx.set_materialize_grads(False)
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> tuple:
        ctx.state.input_grads_hook(ctx)
        return (None, *grads)
