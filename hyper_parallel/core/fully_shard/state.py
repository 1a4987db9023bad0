"""The step state of fully_shard and the hooks that drive it: each module's phase (StepPhase),
each group's backward protocol (GroupBackward), what one root's modules share (_RootContext:
forward order, prefetch, reductions in flight), and the per-module hooks (HSDPState)."""

from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from hyper_parallel._torch_compat import queue_autograd_callback
from hyper_parallel.core.fully_shard.hooks import FullyShardModuleInputs, eager, in_backward
from hyper_parallel.core.fully_shard.offload import finish_offloads
from hyper_parallel.core.fully_shard.param_group import HSDPParamGroup
from hyper_parallel.core.fully_shard.policy import MixedPrecisionPolicy
from hyper_parallel.core.fully_shard.tree import cast_floating, iter_tensors, map_tensors
from hyper_parallel.platform import get_platform


class StepPhase(enum.Enum):
    """Where one fully_shard module is in the current step (FSDP2's ``TrainingState``, per
    module). Back to ``IDLE`` when the step ends (end-of-backward callback,
    ``reset_iter_state``) and when the root's next forward begins."""

    IDLE = "idle"  # not in this step's forward order: no forward with grad has run it yet
    FORWARD = "forward"  # ran forward with grad (in the step's forward order); backward not reached
    BACKWARD = "backward"  # pre-backward ran: parameters unsharded, gradients arriving
    REDUCED = "reduced"  # post-backward ran: gradients reduced (or issued), resharding pending


@dataclasses.dataclass(eq=False)
class GroupBackward:
    """The backward protocol of one parameter group: when it reduces (see [Note: when a group
    reduces]). Kept by the group's owner state; the forward calls it tracks are those of every
    module using the group's parameters (the owner's and those of modules borrowing them). A
    fresh record starts each backward."""

    # The input-gradient nodes (FullyShardModuleInputs) of those calls that have not run yet;
    # weakly held, so a call whose graph was dropped without a backward does not count. Once
    # empty, the owner reduces the group.
    calls: "weakref.WeakSet[Any]" = dataclasses.field(default_factory=weakref.WeakSet)
    # A call had no input that requires grad: nothing marks the end of its backward, so the
    # group reduces in the end-of-backward callback.
    untracked: bool = False
    # A module using the group started its backward: the end-of-backward callback reduces the
    # group if nothing did before.
    started: bool = False


class _RootContext:
    """Step state shared by every fully_shard module under one root module."""

    def __init__(self, states: List["HSDPState"]):
        self.states = states
        self.forward_order: List[HSDPState] = []
        self.next_in_forward: Dict[HSDPState, HSDPState] = {}  # previous step: implicit forward prefetch
        self.prev_in_forward: Dict[HSDPState, HSDPState] = {}  # this step: implicit backward prefetch
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
        # backward's pipeline (or its end) finishes them.
        if self.forward_order:
            order = self.forward_order
            self.next_in_forward = dict(zip(order, order[1:]))
        self.forward_order = []
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

    def record_forward(self, state: "HSDPState") -> None:
        if state.phase is StepPhase.IDLE:
            state.phase = StepPhase.FORWARD
            self.forward_order.append(state)

    def ensure_final_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            order = self.forward_order
            self.prev_in_forward = dict(zip(order[1:], order))
            queue_autograd_callback(self._final_callback_hook)

    def advance_reductions(self) -> None:
        """Pipeline step: finish the all-reduces in flight, then move finished
        reduce-scatters on to their all-reduce (HSDP) or set their gradients (FSDP)."""
        for state in self.states:  # CPU offload: the previous copies' device sources
            state.group.offloads.release_sources()
        for group in self.all_reducing:
            group.finish_all_reduce()
        self.all_reducing = [group for group in self.reducing if group.finish_scatter()]
        self.reducing = []

    def finish_reductions(self) -> None:
        """Advance the pipeline until no reduction is in flight (a reduce-scatter reaches its
        gradients in one step, or in two through its HSDP all-reduce)."""
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
        self.callback_queued = False
        self.all_gathers_ordered = False


class HSDPState:
    """Hooks and step state of one fully_shard module (its phase, its group's GroupBackward).

    Args:
        modules: the wrapped module, or the modules of one ``fully_shard([a, b])`` call:
            the first of them to run in a forward unshards the group, the last reshards it.
        group: its parameter group.
        mp_policy: casts of forward inputs/outputs.
        borrowed: the states owning the groups of parameters this module shares (tied across
            groups); those groups are unsharded around this module's forward and backward too,
            and reduce only once this module's backward is done.
    """

    def __init__(self, modules: Sequence[nn.Module], group: HSDPParamGroup, mp_policy: MixedPrecisionPolicy,
                 borrowed: List["HSDPState"]):
        self.modules = tuple(modules)
        self.group = group
        self.mp_policy = mp_policy
        self.borrowed = borrowed
        self.ctx: Optional[_RootContext] = None
        self.is_root = False
        self.forward_prefetch: Optional[List[HSDPState]] = None  # None: implicit
        self.backward_prefetch: Optional[List[HSDPState]] = None
        self.phase = StepPhase.IDLE
        self.backward = GroupBackward()  # of this state's own group
        self.to_run: Set[nn.Module] = set()  # modules of this group yet to run in this forward
        self.unshard_in_backward = True
        self.is_last_backward = True  # copied to the root context at lazy init
        self.manual_finalization = False  # likewise
        self.post_optim_event: Optional[Any] = None  # likewise
        # Every entry point called by nn.Module or autograd, wrapped once (see hooks.eager);
        # pre_forward_hook/post_forward_hook also run custom forward methods.
        self._pre_backward_hook = eager(self._pre_backward)
        self.input_grads_hook = eager(self._on_input_grads)
        self.pre_forward_hook = eager(self._pre_forward)
        self.post_forward_hook = eager(self._post_forward)
        for module in self.modules:
            module.register_forward_pre_hook(self.pre_forward_hook, prepend=True, with_kwargs=True)
            module.register_forward_hook(self.post_forward_hook)
            module.register_state_dict_pre_hook(lambda *_: group.reshard())
            module.register_load_state_dict_pre_hook(lambda *_: group.reshard())

    # -- initialisation -------------------------------------------------------------------
    def lazy_init(self) -> None:
        """Make this module the root of every fully_shard module in its subtree (once)."""
        if self.ctx is not None and self.is_root:
            return
        if len(self.modules) > 1:
            raise RuntimeError("a fully_shard([...]) group of several modules cannot be the root: "
                               "call fully_shard on a module containing them and run that")
        modules = self.modules[0].modules()
        states = list(dict.fromkeys(m.__dict__["_hsdp_state"] for m in modules if "_hsdp_state" in m.__dict__))
        fqns = {param: name for name, param in self.modules[0].named_parameters(remove_duplicate=False)}
        module_fqns = {module: name for name, module in self.modules[0].named_modules()}
        ctx = _RootContext(states)
        ctx.is_last_backward, ctx.manual_finalization = self.is_last_backward, self.manual_finalization
        ctx.post_optim_event = next((s.post_optim_event for s in states if s.post_optim_event is not None), None)
        for state in states:
            state.ctx, state.is_root = ctx, state is self
            user_value = state.group.user_reshard_after_forward
            state.group.reshard_after_forward = (not state.is_root) if user_value is None else user_value
            state.group.module_fqn = ", ".join(module_fqns[m] for m in state.modules if module_fqns.get(m))
            state.group.lazy_init(fqns)
        for state in states:  # borrowed groups may live outside this subtree
            for owner in state.borrowed:
                owner.group.lazy_init()

    def track_call(self, node: Any) -> None:
        """``node`` (a :class:`FullyShardModuleInputs`) stands for a forward call of this
        module: the groups it uses reduce only once its backward has run."""
        for owner in self.owners:
            owner.backward.calls.add(node)

    @property
    def owners(self) -> Tuple["HSDPState", ...]:
        """This state and the owners of the groups it borrows."""
        return (self, *self.borrowed)

    def reset_forward(self) -> None:
        self.phase = StepPhase.IDLE
        self.to_run.clear()

    def reset_backward(self) -> None:
        self.reset_forward()
        self.backward = GroupBackward()

    def set_reshard_after_forward(self, value: bool) -> None:
        self.group.set_reshard_after_forward(value)

    def set_is_last_backward(self, value: bool) -> None:
        self.is_last_backward = value
        if self.ctx is not None:
            self.ctx.is_last_backward = value

    def set_manual_finalization(self, value: bool) -> None:
        self.manual_finalization = value
        if self.ctx is not None:
            self.ctx.manual_finalization = value

    def set_post_optim_event(self, event: Any) -> None:
        if self.ctx is None:
            self.post_optim_event = event
        else:
            self.ctx.post_optim_event = event

    def reset_iter_state(self) -> None:
        if self.ctx is None:
            return  # never ran: nothing to reset
        if not self.is_root:
            raise RuntimeError("reset_iter_state must be called on the root fully_shard module")
        self.ctx.reset_iter_state()

    # -- hooks ----------------------------------------------------------------------------
    def _unshard(self) -> None:
        ordered = self.ctx.all_gathers_ordered
        for owner in self.owners:
            owner.group.unshard(ordered=ordered)

    def _prefetch(self, states: List["HSDPState"]) -> None:
        for state in states:
            state.group.unshard(async_op=True, ordered=self.ctx.all_gathers_ordered)

    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any):
        if self.ctx is None:
            self.lazy_init()
        recomputing = in_backward()  # checkpoint recomputation: only unshard
        training = not recomputing and torch.is_grad_enabled()
        if not recomputing and self.is_root:
            self.ctx.begin_step()
            self.ctx.order_all_gathers()
        if training:
            self.ctx.record_forward(self)
        if not recomputing and not self.to_run:
            self.to_run.update(self.modules)
        self._unshard()
        if not recomputing:
            self._prefetch_forward()
        dtype = self.mp_policy.param_dtype
        if dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = cast_floating(args, dtype), cast_floating(kwargs, dtype)
        if training:
            args, kwargs = self._hook_input_grads(args, kwargs)
        return args, kwargs

    def _prefetch_forward(self) -> None:
        if self.forward_prefetch is not None:
            self._prefetch(self.forward_prefetch)
        elif self in self.ctx.next_in_forward:
            self._prefetch([self.ctx.next_in_forward[self]])

    def _hook_input_grads(self, args: Any, kwargs: Any) -> tuple:
        """``(args, kwargs)`` with the tensors that require grad passed through one
        :class:`FullyShardModuleInputs` node (see there)."""
        inputs = list({id(t): t for t in iter_tensors((args, kwargs)) if t.requires_grad}.values())
        if not inputs:
            for owner in self.owners:
                owner.backward.untracked = True
            return args, kwargs
        passed = dict(zip(map(id, inputs), FullyShardModuleInputs.apply(self, *inputs)))
        return map_tensors(lambda t: passed.get(id(t), t), (args, kwargs))

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if in_backward():  # recomputation (activation checkpointing): backward needs the params
            # ... and the same output dtype as the original forward (checkpoint checks it)
            if self.mp_policy.output_dtype is not None:
                output = cast_floating(output, self.mp_policy.output_dtype)
            return output
        grad_enabled = torch.is_grad_enabled()
        self.to_run.discard(module)
        if not self.to_run:  # the last of the group's modules to run in this pass
            self._finish_forward(grad_enabled)
            if self.is_root:
                for state in self.ctx.states:
                    if state.to_run:  # a group whose other modules run later (e.g. a chunked loss head)
                        state.to_run.clear()
                        state._finish_forward(grad_enabled)
                if not grad_enabled:
                    self.ctx.end_no_grad_forward()
        if self.mp_policy.output_dtype is not None:
            output = cast_floating(output, self.mp_policy.output_dtype)
        if grad_enabled:
            for tensor in iter_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._pre_backward_hook)
        return output

    def _finish_forward(self, grad_enabled: bool) -> None:
        for group in [owner.group for owner in self.owners]:
            if not grad_enabled:
                group.reshard()
            elif group.reshard_after_forward:
                group.reshard_after_forward_pass()

    def _pre_backward(self, grad: torch.Tensor) -> None:
        if self.phase not in (StepPhase.IDLE, StepPhase.FORWARD):
            return
        self.phase = StepPhase.BACKWARD
        self.ctx.ensure_final_callback()
        for owner in self.owners:
            owner.backward.started = True
        if self.unshard_in_backward:
            self._unshard()
        if self.backward_prefetch is not None:
            targets = self.backward_prefetch
        else:
            targets = [self.ctx.prev_in_forward[self]] if self in self.ctx.prev_in_forward else []
        self._prefetch([state for state in targets if state.unshard_in_backward])

    def post_backward(self) -> None:
        """Reduce the group's gradients (async)."""
        if self.phase is StepPhase.REDUCED:
            return
        self.phase = StepPhase.REDUCED
        self.ctx.ensure_final_callback()
        self.ctx.advance_reductions()  # overlap: at most one group per stage in flight
        if self.group.requires_gradient_sync:
            self.group.reduce_grads()
            self.ctx.reducing.append(self.group)
        else:
            self.group.accumulate_unreduced_grads()

    def _on_input_grads(self, call: Any) -> None:
        for owner in self.owners:
            backward = owner.backward
            if call not in backward.calls:  # counted before an earlier backward's end reset
                continue  # the group (a chunked loss head): this backward's end reduces it
            backward.calls.discard(call)
            if not backward.calls and not backward.untracked:
                owner._backward_done()

    def _backward_done(self) -> None:
        """[Note: when a group reduces] Every forward call of the modules using this group's
        parameters (this module's, and those of modules sharing its parameters) has had the
        gradients w.r.t. its inputs computed: the engine accumulated the parameters' gradients
        before (an AccumulateGrad node runs first among the nodes ready), so the group reduces
        and reshards now. The point is the same on every rank, whatever parameters a rank
        happened to use, so the ranks issue their reductions in the same order. A group whose
        modules had a forward call without an input that requires grad (e.g. the root, or an
        embedding whose weight another module shares) reduces in the end-of-backward callback,
        as with FSDP2."""
        if self.ctx is None:
            return
        self.post_backward()
        if self.group.reshard_after_backward:
            self.group.reshard()
