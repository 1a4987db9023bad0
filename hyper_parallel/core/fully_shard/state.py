"""HSDPState: the hooks of one fully_shard module (forward pre/post, pre-backward, the end of
its inputs' backward) and its step state; the state one root's modules share is the
RootContext (``root_context.py``), the phases are in ``step_phase.py``."""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from hyper_parallel.core.fully_shard.hooks import FullyShardModuleInputs, eager, in_backward
from hyper_parallel.core.fully_shard.param_group import HSDPParamGroup
from hyper_parallel.core.fully_shard.policy import MixedPrecisionPolicy
from hyper_parallel.core.fully_shard.root_context import RootContext
from hyper_parallel.core.fully_shard.step_phase import GroupBackward, StepPhase
from hyper_parallel.core.fully_shard.tree import cast_floating, iter_tensors, map_tensors


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
        self.ctx: Optional[RootContext] = None
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
        RootContext.attach(self)

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
            self.finish_forward(grad_enabled)
            if self.is_root:
                self.ctx.end_forward(grad_enabled)
        if self.mp_policy.output_dtype is not None:
            output = cast_floating(output, self.mp_policy.output_dtype)
        if grad_enabled:
            for tensor in iter_tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._pre_backward_hook)
        return output

    def finish_forward(self, grad_enabled: bool) -> None:
        """The last of this group's modules ran forward: reshard per ``reshard_after_forward``
        (always without grad: no backward follows)."""
        if grad_enabled:
            self.ctx.record_post_forward(self)
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
            targets = [self.ctx.prev_in_backward[self]] if self in self.ctx.prev_in_backward else []
        # (a group whose backward is over, used again earlier in the forward, is not regathered)
        self._prefetch([state for state in targets
                        if state.unshard_in_backward and state.phase is not StepPhase.REDUCED])

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
