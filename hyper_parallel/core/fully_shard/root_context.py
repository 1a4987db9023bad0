"""RootContext: the step state one root module's fully_shard modules share (forward and
post-forward orders, implicit prefetch targets, reductions in flight, end-of-backward callback)
and the root-only steps (ordering the step's all-gathers, finishing the reductions at the end
of backward, resetting an aborted step). What it needs of each module's state is declared here
(:class:`ModuleState`, which ``state.HSDPState`` implements), so this module does not import
``state.py``."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Protocol, Sequence, Set, Tuple

from torch import nn

from hyper_parallel._torch_compat import queue_autograd_callback
from hyper_parallel.core.fully_shard.hooks import eager
from hyper_parallel.core.fully_shard.offload import finish_offloads
from hyper_parallel.core.fully_shard.param_group import HSDPParamGroup
from hyper_parallel.core.fully_shard.step_phase import GroupBackward, StepPhase
from hyper_parallel.platform import get_platform


class ModuleState(Protocol):
    """What the root context needs of one fully_shard module's state (``HSDPState``)."""

    modules: Tuple[nn.Module, ...]  # the module(s) of one fully_shard call
    group: HSDPParamGroup
    borrowed: Sequence["ModuleState"]  # owners of the groups whose parameters it shares
    ctx: Optional["RootContext"]
    is_root: bool
    phase: StepPhase
    backward: GroupBackward
    to_run: Set[nn.Module]  # modules of the group yet to run in this forward
    # Settings made on the root before its first forward, copied to the context by attach.
    is_last_backward: bool
    manual_finalization: bool
    post_optim_event: Optional[Any]

    def reset_forward(self) -> None:
        ...

    def reset_backward(self) -> None:
        ...

    def finish_forward(self, grad_enabled: bool) -> None:
        ...

    def post_backward(self) -> None:
        ...


class RootContext:
    """Step state shared by every fully_shard module under one root module."""

    @classmethod
    def attach(cls, root: ModuleState) -> "RootContext":
        """Make ``root`` the root of every fully_shard module in its subtree: one context for
        them all (taking the settings made on ``root`` before), the root's
        ``reshard_after_forward`` default (False; True for the others), and every group's lazy
        init (which names parameters still on the meta device by their qualified names).

        Raises:
            RuntimeError: ``root`` is a ``fully_shard([...])`` group of several modules.
        """
        if len(root.modules) > 1:
            raise RuntimeError("a fully_shard([...]) group of several modules cannot be the root: "
                               "call fully_shard on a module containing them and run that")
        top = root.modules[0]
        states = list(dict.fromkeys(m.__dict__["_hsdp_state"] for m in top.modules() if "_hsdp_state" in m.__dict__))
        fqns = {param: name for name, param in top.named_parameters(remove_duplicate=False)}
        module_fqns = {module: name for name, module in top.named_modules()}
        ctx = cls(states)
        ctx.is_last_backward, ctx.manual_finalization = root.is_last_backward, root.manual_finalization
        ctx.post_optim_event = next((s.post_optim_event for s in states if s.post_optim_event is not None), None)
        for state in states:
            state.ctx, state.is_root = ctx, state is root
            user_value = state.group.user_reshard_after_forward
            state.group.reshard_after_forward = (not state.is_root) if user_value is None else user_value
            state.group.module_fqn = ", ".join(module_fqns[m] for m in state.modules if module_fqns.get(m))
            state.group.lazy_init(fqns)
        for state in states:  # borrowed groups may live outside this subtree
            for owner in state.borrowed:
                owner.group.lazy_init()
        return ctx

    def __init__(self, states: List[ModuleState]):
        self.states = states
        self.forward_order: List[ModuleState] = []  # pre-forward order: implicit forward prefetch
        self.next_in_forward: Dict[ModuleState, ModuleState] = {}  # previous step's forward order
        # [Note: backward prefetch order] The order in which the groups' forwards finished (one
        # entry per finished forward, as FSDP2's post_forward_order): backward runs it in
        # reverse. The pre-forward order differs where groups nest (an experts group inside a
        # block: pre-forward block, experts; post-forward experts, block), so backward
        # prefetches the group before the one in the post-forward order.
        self.post_forward_order: List[ModuleState] = []
        self.prev_in_backward: Dict[ModuleState, ModuleState] = {}  # this backward: implicit prefetch
        self.reducing: List[HSDPParamGroup] = []  # reduce-scatters in flight
        self.all_reducing: List[HSDPParamGroup] = []  # HSDP all-reduces in flight
        self.callback_queued = False  # the end-of-backward callback, queued once per backward
        # False: the end of backward leaves the last reductions in flight (set_is_last_backward).
        self.is_last_backward = True
        # True: the end of backward leaves its reductions to finalize_backward (set_manual_backward_finalization).
        self.manual_finalization = False
        # The user's event recorded after the optimizer step (set_post_optim_event), used once.
        self.post_optim_event: Optional[Any] = None
        # True from the root's pre-forward until the step ends: the all-gather stream is
        # ordered after the last writes to the shards, so this step's all-gathers need no wait.
        self.all_gathers_ordered = False
        self._final_callback_hook = eager(self._final_callback)

    def begin_step(self) -> None:
        # Reductions a non-last backward left in flight overlap this forward; the next
        # backward's reduction stages (or its end) finish them.
        if self.forward_order:
            order = self.forward_order
            self.next_in_forward = dict(zip(order, order[1:]))
        self.forward_order = []
        self.post_forward_order = []
        for state in self.states:
            # Not the backward counts: forwards run twice before one backward (e.g. DPO's two
            # forwards) each add their calls; the end of backward resets them.
            state.reset_forward()

    def order_all_gathers(self) -> None:
        """Root pre-forward: order the all-gather stream after the optimizer step that wrote
        the shards (the post-optimizer event if the user set one, else everything queued on
        the compute stream), once for the step, as FSDP2 does: the step's all-gathers then
        start as soon as they are issued, with no false dependency on queued compute."""
        streams = get_platform().streams()
        event, self.post_optim_event = self.post_optim_event, None
        if event is None:
            streams.wait_for_current(streams.all_gather)
        else:
            with streams.use(streams.all_gather):
                streams.wait_event(event)
        self.all_gathers_ordered = True

    def record_forward(self, state: ModuleState) -> None:
        if state.phase is StepPhase.IDLE:
            state.phase = StepPhase.FORWARD
            self.forward_order.append(state)

    def record_post_forward(self, state: ModuleState) -> None:
        """``state``'s group finished a forward with grad (see [Note: backward prefetch order])."""
        self.post_forward_order.append(state)

    def ensure_final_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            # a group finishing several forwards prefetches the group before its last one
            order = self.post_forward_order
            self.prev_in_backward = dict(zip(order[1:], order))
            queue_autograd_callback(self._final_callback_hook)

    def advance_reductions(self) -> None:
        """Move every reduction one stage on: finish the all-reduces in flight, then move
        finished reduce-scatters on to their all-reduce (HSDP) or set their gradients (FSDP)."""
        for state in self.states:  # CPU offload: the previous copies' device sources
            state.group.offloads.release_sources()
        for group in self.all_reducing:
            group.finish_all_reduce()
        self.all_reducing = [group for group in self.reducing if group.finish_scatter()]
        self.reducing = []

    def finish_reductions(self) -> None:
        """Advance the reduction stages until no reduction is in flight (a reduce-scatter
        reaches its gradients in one advance, or in two through its HSDP all-reduce)."""
        while self.reducing or self.all_reducing:
            self.advance_reductions()

    def _final_callback(self) -> None:
        for state in self.states:  # (a group whose modules' backward started: rank-consistent)
            if state.phase is not StepPhase.REDUCED and state.backward.started:
                state.post_backward()
        if self.is_last_backward and not self.manual_finalization:
            self.finish_reductions()
        self.finish_backward()
        for state in self.states:
            state.reset_backward()
        self.callback_queued = False
        self.all_gathers_ordered = False  # the optimizer step may write the shards next

    def finish_backward(self) -> None:
        """Host-wait for offloaded gradients; reshard per ``reshard_after_backward``."""
        finish_offloads([state.group.offloads for state in self.states])  # CPU offload: the host waits once
        for state in self.states:
            if state.group.reshard_after_backward:
                state.group.reshard()

    def end_forward(self, grad_enabled: bool) -> None:
        """The root's forward ended: finish the forward of groups whose other modules have
        not run (e.g. a chunked loss head's), and without grad end the step."""
        for state in self.states:
            if state.to_run:
                state.to_run.clear()
                state.finish_forward(grad_enabled)
        if not grad_enabled:
            self.end_no_grad_forward()

    def end_no_grad_forward(self) -> None:
        """No backward follows: drop prefetched leftovers; the step is over."""
        for state in self.states:
            state.group.reshard()
        self.all_gathers_ordered = False

    def reset_iter_state(self) -> None:
        """Discard a step aborted by an exception: wait for its collectives, drop its
        unreduced gradients, reshard, and forget its forward order and step state."""
        for state in self.states:
            state.group.reset_iter_state()
            state.reset_backward()
        self.reducing, self.all_reducing = [], []
        self.forward_order = []
        self.post_forward_order = []
        self.callback_queued = False
        self.all_gathers_ordered = False
