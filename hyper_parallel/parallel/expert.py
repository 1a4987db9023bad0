"""Expert parallelism: a grouped-experts module's experts split over an ``ep`` mesh, tokens
sent to the rank holding their expert and back with two all-to-alls.

:class:`ExpertParallel` is a torch ``ParallelStyle`` for any module honouring
:class:`GroupedExperts`: each parameter (dim 0 = experts) becomes a DTensor ``Shard(0)`` over
the 1-D ``ep`` mesh, so a rank holds ``num_experts / ep`` consecutive experts, and every call
``experts(x, num_tokens_per_expert)`` (``x``'s rows sorted by global expert) runs as

1. :func:`dispatch_tokens`: the per-expert counts are exchanged first (one small all-to-all),
   then the tokens (an all-to-all with uneven splits: to rank ``r`` the rows of its experts);
   the received rows, grouped by source rank, are re-sorted by local expert;
2. the module's own forward on the local rows with the local counts (its DTensor parameters
   seen as their local shards);
3. :func:`combine_tokens`: the inverse: rows back in source-rank order, then the reverse
   all-to-all, so the result lines up with ``x``.

Both all-to-alls are differentiable (the backward of each is the reverse all-to-all of the
gradient). Apply it before ``fully_shard`` (which then shards the experts over the rest of the
data-parallel ranks, see :func:`expert_meshes`; under HSDP also replicated over the
replicas)::

    ep_mesh, efsdp_mesh = expert_meshes(dp_mesh, ep)
    parallelize_module(moe.experts, ep_mesh, ExpertParallel())
"""

from __future__ import annotations

import enum
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, List, Optional, Protocol, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from hyper_parallel._torch_compat import module_parameters, unflatten_mesh

__all__ = ["ExpertParallel", "GroupedExperts", "Routing", "combine_tokens", "dispatch_tokens", "distribute_experts",
           "expert_meshes"]


class GroupedExperts(Protocol):
    """The experts module :class:`ExpertParallel` shards: every parameter has the experts on
    dim 0, and ``forward`` maps rows sorted by expert (``num_tokens_per_expert[e]`` rows for
    expert ``e``, int64) to one output row each."""

    def forward(self, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor: ...


class _Problem(enum.IntEnum):
    """What a rank found wrong with its own routing input (sent with its counts, so that every
    rank of the ep group raises instead of waiting in the token all-to-all)."""

    NONE = 0
    SHAPE = 1
    NEGATIVE = 2
    SUM = 3


@dataclass(frozen=True)
class Routing:
    """Where one dispatch sent the tokens, kept for the combine.

    ``input_splits[r]``: rows this rank sent to ep rank ``r``; ``output_splits[r]``: rows it got
    from ``r``; ``order``: for each row the local experts see, its row in the received
    (source-rank-major) buffer; ``local_counts``: rows per local expert.
    """

    input_splits: List[int]
    output_splits: List[int]
    order: Tensor
    local_counts: Tensor


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` over dim 0 with uneven splits; backward: the reverse one."""

    @staticmethod
    def forward(ctx, x: Tensor, output_splits: List[int], input_splits: List[int], group) -> Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def _all_to_all(x: Tensor, output_splits: List[int], input_splits: List[int], group) -> Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def _local_problem(x: Tensor, counts: Tensor, num_experts: int) -> Tuple[_Problem, str]:
    """A problem visible without reading the counts' values (no device sync)."""
    if x.dim() != 2:
        return _Problem.SHAPE, f"tokens must be 2-D [tokens, dim], got shape {tuple(x.shape)}"
    if counts.dim() != 1 or counts.numel() != num_experts or counts.is_floating_point() or counts.is_complex():
        return _Problem.SHAPE, (f"num_tokens_per_expert must be an integer tensor of {num_experts} entries "
                                f"(one per expert), got {counts.dtype} of shape {tuple(counts.shape)}")
    return _Problem.NONE, ""


def dispatch_tokens(x: Tensor, num_tokens_per_expert: Tensor, ep_mesh: DeviceMesh,
                    num_experts: int) -> Tuple[Tensor, Routing]:
    """Send each row of ``x`` (sorted by global expert) to the ep rank holding its expert.

    Returns the rows of this rank's experts, sorted by local expert, and the :class:`Routing`
    that :func:`combine_tokens` inverts. The counts go first, in one all-to-all that also carries
    each rank's input check and token width, so bad input on any rank raises on every rank.

    Raises:
        ValueError: this or another rank of the ep group passed inconsistent tokens/counts.
    """
    group, ep = ep_mesh.get_group(), ep_mesh.size()
    local = num_experts // ep
    problem, message = _local_problem(x, num_tokens_per_expert, num_experts)
    device = x.device
    # Row r of ``send``: the counts of ep rank r's experts, then this rank's problem and width.
    send = torch.zeros((ep, local + 2), dtype=torch.int64, device=device)
    if problem is _Problem.NONE:
        counts = num_tokens_per_expert.to(device=device, dtype=torch.int64).view(ep, local)
        send[:, :local] = counts
        send[:, local] = torch.where((counts < 0).any(), _Problem.NEGATIVE,
                                     torch.where(counts.sum() != x.shape[0], _Problem.SUM, _Problem.NONE))
    else:
        send[:, local] = problem
    send[:, local + 1] = x.shape[-1] if x.dim() else 0
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    # One device-to-host copy: splits, every rank's problem and width.
    input_splits, output_splits, problems, widths = torch.stack(
        [send[:, :local].sum(1), received[:, :local].sum(1), received[:, local], received[:, local + 1]]).tolist()
    _raise_on_problems(problems, widths, message, num_tokens_per_expert, x, ep_mesh)

    tokens = _AllToAll.apply(x, output_splits, input_splits, group)
    # Received rows: from rank 0 its rows for local experts 0..L-1, then rank 1's, ...; the
    # local experts need them expert-major: a stable sort by local expert keeps source order.
    segment = torch.repeat_interleave(torch.arange(ep * local, device=device), received[:, :local].reshape(-1),
                                      output_size=tokens.shape[0])
    order = torch.argsort(segment % local, stable=True)
    routing = Routing(input_splits, output_splits, order, received[:, :local].sum(0))
    return tokens.index_select(0, order), routing


def _raise_on_problems(problems: List[int], widths: List[int], message: str, counts: Tensor, x: Tensor,
                       ep_mesh: DeviceMesh) -> None:
    me = ep_mesh.get_local_rank()
    if problems[me] == _Problem.NEGATIVE:
        message = f"num_tokens_per_expert has a negative count: {counts.tolist()}"
    elif problems[me] == _Problem.SUM:
        message = (f"num_tokens_per_expert sums to {int(counts.sum())} but the tokens have {x.shape[0]} rows "
                   f"(rows must be sorted by expert, one row per count)")
    if problems[me] != _Problem.NONE:
        raise ValueError(f"expert parallel dispatch: {message}")
    bad = [r for r, p in enumerate(problems) if p != _Problem.NONE]
    if bad:
        group_ranks = ep_mesh.mesh.flatten().tolist()
        raise ValueError(f"expert parallel dispatch: rank {group_ranks[bad[0]]} of the ep group "
                         f"{group_ranks} passed invalid tokens or counts (its own error says which)")
    if len(set(widths)) > 1:
        raise ValueError(f"expert parallel dispatch: the tokens' width differs across the ep group "
                         f"{ep_mesh.mesh.flatten().tolist()}: {widths}")


def combine_tokens(y: Tensor, routing: Routing, ep_mesh: DeviceMesh) -> Tensor:
    """The inverse of :func:`dispatch_tokens` for the experts' output ``y`` (one row per row
    they got): back to source-rank order, then to the ranks the rows came from."""
    inverse = torch.empty_like(routing.order)
    inverse[routing.order] = torch.arange(routing.order.numel(), device=routing.order.device)
    by_source = y.index_select(0, inverse)
    return _AllToAll.apply(by_source, routing.input_splits, routing.output_splits, ep_mesh.get_group())


@contextmanager
def _local_parameters(module: nn.Module) -> Iterator[None]:
    """The module's DTensor parameters replaced by their (differentiable) local shards."""
    swapped = []
    for sub in module.modules():
        params = module_parameters(sub)
        for name, param in params.items():
            if isinstance(param, DTensor):
                swapped.append((params, name, param))
                params[name] = param.to_local()
    try:
        yield
    finally:
        for params, name, param in swapped:
            params[name] = param


def _expert_parallel_forward(forward, ep_mesh: DeviceMesh, num_experts: int, module: nn.Module,
                             x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
    tokens, routing = dispatch_tokens(x, num_tokens_per_expert, ep_mesh, num_experts)
    with _local_parameters(module):
        out = forward(module, tokens, routing.local_counts)
    return combine_tokens(out, routing, ep_mesh)


class _Forward:
    """The module's class ``forward`` wrapped in dispatch/combine (bound to the module with
    ``types.MethodType``, so a deepcopy of the module binds the copy)."""

    def __init__(self, forward, ep_mesh: DeviceMesh, num_experts: int):
        self.forward, self.ep_mesh, self.num_experts = forward, ep_mesh, num_experts

    def __call__(self, module: nn.Module, x: Tensor, num_tokens_per_expert: Tensor) -> Tensor:
        return _expert_parallel_forward(self.forward, self.ep_mesh, self.num_experts, module, x,
                                        num_tokens_per_expert)


class ExpertParallel(ParallelStyle):
    """Shard a :class:`GroupedExperts` module's experts over a 1-D ``ep`` mesh and route its
    tokens there and back (use with ``parallelize_module(experts, ep_mesh, ExpertParallel())``).

    Raises (at apply):
        ValueError: the mesh is not 1-D, the module has no parameters, its parameters disagree
            on the number of experts, the experts do not divide over the mesh, a parameter is
            already a DTensor (apply before ``fully_shard``), or its forward is already replaced.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if "forward" in vars(module):
            raise ValueError(f"ExpertParallel: {type(module).__name__}'s forward is already replaced "
                             f"(expert parallelism applied twice?)")
        num_experts = distribute_experts(module, device_mesh, src_data_rank=self.src_data_rank)
        module.forward = types.MethodType(_Forward(type(module).forward, device_mesh, num_experts), module)
        return module


def distribute_experts(module: nn.Module, mesh: DeviceMesh, *, src_data_rank: Optional[int] = 0) -> int:
    """Make every parameter of ``module`` (experts on dim 0) a DTensor ``Shard(0)`` over the 1-D
    ``mesh``, in place (on the meta device too); returns the number of experts. ``src_data_rank``:
    as ``distribute_tensor``'s.

    Raises:
        ValueError: as :class:`ExpertParallel` at apply (mesh, parameters, divisibility).
    """
    num_experts = _check_experts(module, mesh)
    for sub in module.modules():
        params = module_parameters(sub)
        for name, param in list(params.items()):
            if param is not None:
                sharded = distribute_tensor(param.data, mesh, [Shard(0)], src_data_rank=src_data_rank)
                params[name] = nn.Parameter(sharded, requires_grad=param.requires_grad)
    return num_experts


def _check_experts(module: nn.Module, mesh: DeviceMesh) -> int:
    """The module's number of experts (its parameters' common dim 0), checked against ``mesh``."""
    if mesh.ndim != 1:
        raise ValueError(f"ExpertParallel needs a 1-D ep mesh, got {mesh.ndim}-D {mesh}")
    named = list(module.named_parameters())
    if not named:
        raise ValueError(f"ExpertParallel: {type(module).__name__} has no parameters to shard over experts")
    for name, param in named:
        if isinstance(param, DTensor):
            raise ValueError(f"ExpertParallel: parameter {name!r} is already a DTensor; apply expert "
                             f"parallelism before fully_shard or tensor parallelism")
    sizes = {name: (param.shape[0] if param.dim() else 0) for name, param in named}
    num_experts = sizes[named[0][0]]
    if len(set(sizes.values())) > 1:
        raise ValueError(f"ExpertParallel: every parameter must hold the experts on dim 0, but the "
                         f"dim-0 sizes differ: {sizes}")
    if num_experts == 0 or num_experts % mesh.size():
        raise ValueError(f"ExpertParallel: {num_experts} experts do not divide over an ep mesh of "
                         f"{mesh.size()} ranks")
    return num_experts


def expert_meshes(dp_mesh: DeviceMesh, ep: int) -> Tuple[DeviceMesh, DeviceMesh]:
    """``(ep_mesh, efsdp_mesh)``: the data-parallel shard ranks regrouped for the experts.

    ``dp_mesh`` is the named data-parallel mesh: 1-D (FSDP: its shard dim) or 2-D (HSDP:
    replicate, shard). Its shard dim is reshaped to ``(dp_shard // ep, ep)`` (dims ``"efsdp"``,
    ``"ep"``; torchtitan's order): shard position ``i`` is ``efsdp_index * ep + ep_index``, so an
    ep group is ``ep`` consecutive shard positions of one replica. The experts are sharded by
    FSDP over ``efsdp_mesh``, across the ep groups: the 1-D ``("efsdp",)`` mesh under FSDP, the
    2-D ``(<replicate dim>, "efsdp")`` mesh under HSDP (experts replicated over the replicas as
    the dense weights are). Both meshes are slices of one mesh (so fully_shard can join them)
    and are created on every rank, as any DeviceMesh.

    Raises:
        ValueError: the mesh is not 1-D or 2-D or has no dim names, or ``ep`` does not divide
            its shard dim.
    """
    if dp_mesh.ndim not in (1, 2):
        raise ValueError(f"expert_meshes needs the 1-D data-parallel shard mesh or the 2-D (replicate, shard) "
                         f"mesh, got {dp_mesh.ndim}-D {dp_mesh}")
    if dp_mesh.mesh_dim_names is None:
        raise ValueError("expert_meshes needs a named mesh: build it with init_device_mesh(..., mesh_dim_names=...)")
    shard_dim = dp_mesh.ndim - 1
    size = dp_mesh.size(shard_dim)
    if not isinstance(ep, int) or ep < 1 or size % ep:
        raise ValueError(f"expert parallel degree {ep!r} does not divide the {size} data-parallel shard ranks")
    mesh = unflatten_mesh(dp_mesh, shard_dim, (size // ep, ep), ("efsdp", "ep"))
    return mesh["ep"], mesh[(*dp_mesh.mesh_dim_names[:shard_dim], "efsdp")]
