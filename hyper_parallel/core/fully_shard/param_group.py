"""HSDPParamGroup: the parameters of one fully_shard call and their collectives.

Parameters are split by mesh (``mesh_subgroup.py``: one sub-group per mesh, usually one) and
bucketed by dtype (``flat_bucket.py``: the flat buffers and their layout). Per bucket the group
issues one all-gather and, after backward, one reduce-scatter and, for HSDP, one all-reduce
over the replicate dim, each on its own side stream of the platform; it issues every bucket's
collective before waiting for any, so that those of different meshes overlap. It owns the
sharded / unsharded state machine and the reductions in flight.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.profiler import record_function

from hyper_parallel._torch_compat import disable_functorch_if_active, local_tensor, module_parameters
from hyper_parallel.core.fully_shard import collectives
from hyper_parallel.core.fully_shard.flat_bucket import FlatBucket
from hyper_parallel.core.fully_shard.hooks import in_backward
from hyper_parallel.core.fully_shard.in_flight import InFlightGather, PendingReduce, PostForwardShards, UnshardHandle
from hyper_parallel.core.fully_shard.offload import GradOffload
from hyper_parallel.core.fully_shard.mesh_subgroup import MeshSubgroup
from hyper_parallel.core.fully_shard.param import HSDPParam
from hyper_parallel.core.fully_shard.slots import ParamSlot, UnshardedSlot
from hyper_parallel.core.fully_shard.step_phase import ShardState
from hyper_parallel.core.fully_shard.policy import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from hyper_parallel.platform import get_platform


class HSDPParamGroup:
    """The parameters of one fully_shard call, their state machine and their collectives.

    Args:
        meshes: the parameters by mesh (one :class:`MeshSubgroup` each, in the order the
            meshes first appear among the parameters).
        mp_policy, offload_policy: the call's policies.
        reshard_after_forward: the call's value (None: decided at the root's lazy init).
    """

    def __init__(self, meshes: List[MeshSubgroup], mp_policy: MixedPrecisionPolicy,
                 offload_policy: OffloadPolicy, reshard_after_forward: Optional[bool]):
        self.meshes = meshes
        self.params = [p for sub in meshes for p in sub.params]
        self.mp_policy = mp_policy
        self.offload = isinstance(offload_policy, CPUOffloadPolicy)
        self.pin_memory = self.offload and offload_policy.pin_memory and get_platform().pin_memory_available()
        self.user_reshard_after_forward = reshard_after_forward
        self.reshard_after_forward = True if reshard_after_forward is None else reshard_after_forward
        self.reshard_after_backward = True
        self._post_forward: Optional[PostForwardShards] = None  # SHARDED_POST_FORWARD only
        self.module_fqn = ""  # the modules' names under the root (its lazy init), for profiler labels
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.state = ShardState.SHARDED
        self.device = get_platform().current_device()
        self._gathers: List[InFlightGather] = []
        self._streams = get_platform().streams()
        self._pending: List[PendingReduce] = []  # reduce-scatters in flight
        self._all_reducing: List[PendingReduce] = []  # HSDP all-reduces in flight
        self.offloads = GradOffload(self._streams)  # reduced gradients copied to host memory
        self._initialized = False
        self._all_reduce_hook: Optional[Callable[[torch.Tensor], None]] = None
        self._all_reduce_hook_stream: Optional[Any] = None  # None: the all-reduce stream
        # torch's AllGather / ReduceScatter comms (set_custom_*; None: torch.distributed's).
        self.all_gather_comm: Optional[Any] = None
        self.reduce_scatter_comm: Optional[Any] = None
        self._sharded_slots: List[ParamSlot] = []
        self._unsharded_slots: List[UnshardedSlot] = []
        self._bind_buckets(lambda p: p._initial_local.device, pin=False)

    @property
    def buckets(self) -> List[FlatBucket]:
        """Every bucket of every mesh, mesh by mesh."""
        return [bucket for sub in self.meshes for bucket in sub.buckets]

    def _mesh_buckets(self) -> Iterator[Tuple[MeshSubgroup, FlatBucket]]:
        return ((sub, bucket) for sub in self.meshes for bucket in sub.buckets)

    # -- set-up ---------------------------------------------------------------------------
    def add_slot(self, param: HSDPParam, module: torch.nn.Module, name: str) -> None:
        """Register another module attribute holding ``param`` (a tied parameter)."""
        param.slots.append((module, name))
        module_parameters(module)[name] = param.sharded_param
        self._sharded_slots.append(ParamSlot(module_parameters(module), name, param.sharded_param))
        if self._initialized:
            self._unsharded_slots.append(UnshardedSlot(module_parameters(module), name, param))

    def _bind_buckets(self, device_of: Callable[[HSDPParam], torch.device], pin: bool) -> None:
        """Bucket each mesh's parameters by their current dtype, bind their shards into flat
        buffers on ``device_of(param)`` (MeshSubgroup.bind_buckets) and, once initialised, their
        unsharded parameters."""
        for sub in self.meshes:
            sub.bind_buckets(device_of, pin, self.offload)
        self._sharded_slots = [ParamSlot(module_parameters(m), n, p.sharded_param)
                               for p in self.params for m, n in p.slots]
        if self._initialized:
            self._bind_unsharded()

    def _bind_unsharded(self) -> None:
        for bucket in self.buckets:
            bucket.bind_unsharded(self.device)
        self._unsharded_slots = [UnshardedSlot(module_parameters(m), n, p) for p in self.params for m, n in p.slots]

    def _adopt_replacements(self) -> bool:
        """Rebind after parameters were replaced on the modules or converted (``setattr``,
        ``load_state_dict(assign=True)``, ``module.to(dtype/device)``, ``to_empty``): buckets
        follow the parameters' new dtypes and devices. Call while sharded. True if it rebound."""
        if not any([p.adopt_replacement() for p in self.params]):
            return False
        self._bind_buckets(_current_device, self.pin_memory and self._initialized)
        return True

    def _sync_requires_grad(self) -> None:
        """Take ``requires_grad`` changes made on the sharded parameters since the last forward."""
        changed = False
        for param in self.params:
            requires_grad = param.sharded_param.requires_grad
            if param.requires_grad != requires_grad:
                param.requires_grad = requires_grad
                if param.unsharded_param is not None:
                    param.unsharded_param.requires_grad_(requires_grad)
                changed = True
        if changed:
            for bucket in self.buckets:
                bucket.update_trainable()

    @disable_functorch_if_active
    def lazy_init(self, names: Optional[Dict[torch.Tensor, str]] = None) -> None:
        """Bind shards to where the parameters now live (after ``to_empty``, ``to``, or a
        replacement), allocate the unsharded buffers and register the gradient hooks. Runs once.

        Raises:
            RuntimeError: parameters are still on the meta device (named from ``names``, a
                map of parameter to qualified name, where given; torch's wording).
        """
        if self._initialized:
            return
        self._adopt_replacements()
        on_meta = [(names or {}).get(p.sharded_param, "?") for p in self.params
                   if local_tensor(p.sharded_param).is_meta]
        if on_meta:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, but the "
                f"following were still on meta device: {on_meta}\nFor example, call "
                "module.to_empty(device=...) and initialise them (e.g. reset_parameters()).")
        self._initialized = True
        self._bind_buckets(_current_device, self.pin_memory)

    # -- unshard / reshard ----------------------------------------------------------------
    @disable_functorch_if_active
    def unshard(self, async_op: bool = False, ordered: bool = False) -> Optional[UnshardHandle]:
        """All-gather this group's parameters (no-op when already (being) unsharded from
        up-to-date shards).

        Args:
            async_op: return a handle instead of waiting for the result.
            ordered: the all-gather stream is already ordered after the last writes to the
                shards (the root's pre-forward did it for this step); otherwise it waits for
                the compute stream first.
        """
        if self.state == ShardState.UNSHARDED and any(b.stale for b in self.buckets):
            self.reshard()
        # On CPU an all-gather issued while autograd runs (a backward prefetch) completes
        # before this returns, as all of FSDP2's do on CPU: gloo receives into a temporary of
        # the unsharded size that lives until the collective ends, which would otherwise sit
        # on top of the backward's peak (measured in benchmarks/RESULTS.md, "Peak step RSS").
        # An unshard waited for here on several meshes issues every mesh's all-gather before
        # waiting for any, so that they run at the same time (their results are all needed).
        host_async = self._streams.async_collectives and (
            (async_op and not in_backward()) or (not async_op and len(self.meshes) > 1))

        def gather(sub: MeshSubgroup, bucket: FlatBucket, piece: Optional[torch.Tensor]) -> tuple:
            if piece is None:
                return bucket.all_gather(sub.dp.shard_group, self.device, host_async)
            size, group = sub.post_forward_group
            return bucket.all_gather_pieces(piece, group, size, host_async)

        if self.state == ShardState.SHARDED_POST_FORWARD:
            kept, self._post_forward = self._post_forward, None
            # The pieces were cut on the compute stream after the root's ordering point.
            self._issue_gathers(gather, kept.pieces, after=kept.written, wait_for_compute=not ordered)
        elif self.state == ShardState.SHARDED:
            rebound = self._adopt_replacements()  # a rebind copies shards on the compute stream
            self._sync_requires_grad()
            self._issue_gathers(gather, [None] * len(self.buckets), wait_for_compute=rebound or not ordered)
        if async_op:
            return UnshardHandle(self)
        self.wait_for_unshard()
        return None

    def _issue_gathers(self, gather: Callable[[MeshSubgroup, FlatBucket, Any], tuple], inputs: List[Any],
                       wait_for_compute: bool, after: Optional[Any] = None) -> None:
        """Run ``gather(mesh, bucket, input)`` for every bucket on the all-gather stream, after what
        the compute stream has queued (``wait_for_compute``) and after the event ``after``;
        the inputs stay referenced by the in-flight records until :meth:`wait_for_unshard`."""
        streams = self._streams
        if wait_for_compute:
            streams.wait_for_current(streams.all_gather)
        with self._range("all_gather"), streams.use(streams.all_gather):
            streams.reclaim(streams.all_gather)  # earlier results: reused after their copy-outs
            if after is not None:
                streams.wait_event(after)
            with collectives.custom_all_gather(self.all_gather_comm):
                issued = [(b, *gather(sub, b, x), x) for (sub, b), x in zip(self._mesh_buckets(), inputs)]
            event = streams.record_event()
        self._gathers = [InFlightGather(b, work, gathered, event, x) for b, work, gathered, x in issued]
        self.state = ShardState.UNSHARDING

    @disable_functorch_if_active
    def wait_for_unshard(self) -> None:
        if self.state != ShardState.UNSHARDING:
            return
        streams = self._streams
        with self._range("all_gather_copy_out"):
            for item in self._gathers:
                if item.work is not None:
                    item.work.wait()
                streams.wait_event(item.event)
                item.bucket.copy_out(item.gathered)
                streams.free_after_use(item.gathered, streams.all_gather)
        self._gathers = []
        for slot in self._unsharded_slots:
            slot.register()
        self.state = ShardState.UNSHARDED

    def reshard_after_forward_pass(self) -> None:
        """Reshard after a forward that backward will follow: fully, or with
        ``reshard_after_forward=<int>`` keep the shards of a smaller group so that backward
        all-gathers only within it (a mesh whose shard world is that size reshards fully)."""
        kept = [sub.post_forward_group for sub, _ in self._mesh_buckets()]
        if not any(kept) or self.state in (ShardState.SHARDED, ShardState.SHARDED_POST_FORWARD):
            self.reshard()
            return
        self.wait_for_unshard()
        pieces = [None if group is None else b.post_forward_piece(group[0], sub.dp.shard_rank % group[0])
                  for (sub, b), group in zip(self._mesh_buckets(), kept)]
        self.reshard()
        self._post_forward = PostForwardShards(pieces, self._streams.record_event())
        self.state = ShardState.SHARDED_POST_FORWARD

    @disable_functorch_if_active
    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones on the modules."""
        self._post_forward = None
        if self.state in (ShardState.SHARDED, ShardState.SHARDED_POST_FORWARD):
            self.state = ShardState.SHARDED
            return
        self.wait_for_unshard()
        for slot in self._sharded_slots:
            slot.register()
        for bucket in self.buckets:
            bucket.free_unsharded()
        self.state = ShardState.SHARDED

    def _range(self, name: str) -> record_function:
        """A profiler range labelled with the group's modules (collectives.profiler_label)."""
        return record_function(collectives.profiler_label(name, self.module_fqn))

    # -- gradients ------------------------------------------------------------------------
    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` on every mesh (default: each mesh's
        data-parallel size)."""
        for sub in self.meshes:
            sub.set_gradient_divide_factor(factor)

    def set_reshard_after_forward(self, value: bool) -> None:
        """Resharding after forward, fully (True) or not at all (False), on every mesh."""
        self.user_reshard_after_forward = self.reshard_after_forward = value
        for sub in self.meshes:
            sub.post_forward_group = None

    def reset_iter_state(self) -> None:
        """After an aborted step: wait for and drop this group's reductions in flight, partial
        (HSDP) sums and unreduced unsharded gradients; reshard."""
        for item in self._pending + self._all_reducing:
            self._wait_reduction(item)
        self.offloads.discard()
        self._pending, self._all_reducing = [], []
        for bucket in self.buckets:
            bucket.partial_grad, bucket.local_grads = None, None
        for param in self.params:
            param.accumulated_grad = None
            if param.unsharded_param is not None:
                param.unsharded_param.grad = None
        self.reshard()

    def accumulate_unreduced_grads(self) -> None:
        """Gradient sync is off this backward: keep the unsharded grads summed in the reduce
        dtype where it differs from the compute dtype (the next synced backward reduces them)."""
        for bucket in self.buckets:
            bucket.accumulate_unreduced_grads()

    def has_unreduced_grads(self) -> bool:
        """A backward without gradient sync left unsharded gradients to reduce."""
        return any(p.accumulated_grad is not None or (p.unsharded_param is not None and p.unsharded_param.grad is not None)
                   for p in self.params)

    def reduce_grads(self) -> None:
        """Issue the reduce-scatter of every bucket's unsharded gradients on the reduce-scatter
        stream: of every bucket with trainable parameters, also one without gradients on this
        rank (other ranks may have some: the ranks issue the same collectives)."""
        streams = self._streams
        for sub, bucket in self._mesh_buckets():
            grad_input = bucket.gradient_input()
            if grad_input is None:
                continue
            if sub.pre_factor != 1:
                grad_input.div_(sub.pre_factor)
            if sub.dp.shard_size == 1:  # nothing to scatter: the input is this rank's result
                self._pending.append(PendingReduce(sub, bucket, None, None, None, grad_input))
                continue
            output = torch.empty(bucket.reduced_numel, dtype=bucket.reduce_dtype, device=grad_input.device)
            streams.wait_for_current(streams.reduce_scatter)  # the copy-in ran on the compute stream
            with self._range("reduce_scatter"), streams.use(streams.reduce_scatter):
                work = collectives.reduce_scatter(output, grad_input, sub.reduce_scatter_group,
                                                  async_op=streams.async_collectives, comm=self.reduce_scatter_comm)
                event = streams.record_event()
            self._pending.append(PendingReduce(sub, bucket, work, event, streams.hold_for_collective(grad_input),
                                               output))

    def _wait_reduction(self, item: PendingReduce) -> None:
        """Order the compute stream (CPU: the host) after ``item``'s collective."""
        if item.work is not None:
            item.work.wait()
        self._streams.wait_event(item.event)

    def finish_scatter(self) -> bool:
        """Wait for the issued reduce-scatters. FSDP: set the sharded gradients. HSDP: issue
        the all-reduce over the replicate dim and return True: call :meth:`finish_all_reduce`
        later. (With ``requires_all_reduce=False`` the result is kept as a partial sum for the
        next all-reduce instead.)"""
        pending, self._pending = self._pending, []
        streams = self._streams
        for item in pending:
            self._wait_reduction(item)  # from here the compute stream may reuse the input's memory
            sub, bucket, reduced = item.mesh, item.bucket, item.output
            if not sub.dp.is_hsdp:
                self._set_grads(sub, bucket, reduced)
                continue
            # On its own stream, after this group's reduce-scatter (FSDP2): not behind the next group's
            # reduce-scatter. A partial sum, or an input no reduce-scatter wrote, is the compute stream's.
            on_compute = bucket.partial_grad is not None or item.event is None
            if bucket.partial_grad is not None:
                reduced += bucket.partial_grad
                bucket.partial_grad = None
            if not self.requires_all_reduce:
                bucket.partial_grad = reduced
                continue
            if on_compute:
                streams.wait_for_current(streams.all_reduce)
            with self._range("all_reduce"), streams.use(streams.all_reduce):
                if not on_compute:
                    streams.wait_event(item.event)
                work = collectives.all_reduce(reduced, sub.dp.replicate_group, async_op=streams.async_collectives)
                event = streams.record_event()
            self._all_reducing.append(PendingReduce(sub, bucket, work, event, None, reduced))
        return bool(self._all_reducing)

    def finish_all_reduce(self) -> None:
        """Wait for the replicate all-reduces (HSDP) and set the sharded gradients."""
        items, self._all_reducing = self._all_reducing, []
        for item in items:
            self._wait_reduction(item)
            self._set_grads(item.mesh, item.bucket, item.output)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], stream: Optional[Any]) -> None:
        """Run ``hook`` in place on every reduced flat gradient (see FSDPModule.set_all_reduce_hook)."""
        if stream is not None and any(sub.dp.is_hsdp for sub in self.meshes):
            # torch's wording (its tests compare it): the hook runs on the all-reduce's stream
            raise ValueError("stream cannot be set when using native HSDP")
        self._all_reduce_hook, self._all_reduce_hook_stream = hook, stream

    def _run_all_reduce_hook(self, reduced: torch.Tensor) -> None:
        streams = self._streams
        stream = self._all_reduce_hook_stream or streams.all_reduce
        streams.wait_for_current(stream)  # the gradient was divided on the compute stream
        with self._range("all_reduce_hook"), streams.use(stream):
            self._all_reduce_hook(reduced)
            done = streams.record_event()
        streams.wait_event(done)

    def _set_grads(self, sub: MeshSubgroup, bucket: FlatBucket, reduced: torch.Tensor) -> None:
        if sub.post_factor != 1:
            reduced.div_(sub.post_factor)
        if self._all_reduce_hook is not None:
            self._run_all_reduce_hook(reduced[:bucket.grad_total])
        if self.offload:
            self.offloads.copy(bucket, reduced, self.pin_memory, self.module_fqn)
            return
        bucket.assign_grads(reduced, bucket.take_local_grads())


def _current_device(param: HSDPParam) -> torch.device:
    """Where the parameter's sharded values live now."""
    return local_tensor(param.sharded_param).device
