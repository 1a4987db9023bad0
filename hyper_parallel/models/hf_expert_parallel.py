"""Expert parallelism (``parallel.ep``) for a ``transformers`` mixture of experts (``model=hf``).

``transformers`` 5 holds a MoE layer's routed experts as one module of fused 3-D weights
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) whose ``forward(hidden_states,
top_k_index, top_k_weights)`` dispatches through its experts interface
(``@use_experts_implementation``, ``transformers.integrations.moe.ExpertsInterface``), as
attention does through the attention interface. :func:`apply_expert_parallel` splits each such
module's experts over the ``ep`` mesh (DTensor ``Shard(0)``:
:func:`~hyper_parallel.parallel.expert.distribute_experts`, a rank holds ``E / ep`` consecutive
experts) and makes :data:`EXPERT_PARALLEL`, registered with that interface, the model's experts
implementation (:func:`expert_parallel_forward`): the ``(token, expert)`` pairs sorted by expert
go to the ranks holding their experts and back through
:func:`~hyper_parallel.parallel.expert.dispatch_tokens` /
:func:`~hyper_parallel.parallel.expert.combine_tokens` (one all-to-all pair per layer), the local
experts run on the local shards with the model's activation, and each token sums its ``top_k``
outputs weighted by the router's weights. The router, its load-balancing loss and the names
are the model's own.

Experts of another layout (transposed, with biases, without a gate, a post-expert norm, or not
through the interface at all) are refused by :func:`expert_parallel_problems` in one line.
"""

from __future__ import annotations

import weakref
from functools import lru_cache
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hyper_parallel._torch_compat import grouped_mm
from hyper_parallel.models.grouped_experts import ExpertMatmul, expert_matmul
from hyper_parallel.parallel.expert import combine_tokens, dispatch_tokens, distribute_experts

__all__ = ["EXPERT_PARALLEL", "apply_expert_parallel", "expert_parallel_forward", "expert_parallel_problems",
           "grouped_experts"]

#: The name of the expert-parallel forward in ``transformers``' experts interface.
EXPERT_PARALLEL = "hyper_parallel_ep"

# The fused weights of the layout computed here, and the decorator's flags that describe it:
# [gate; up] concatenated on dim 1, laid out as nn.Linear weights (out x in), no biases.
_WEIGHTS = ("gate_up_proj", "down_proj")
_LAYOUT = {"has_gate": True, "is_concatenated": True, "is_transposed": False, "has_bias": False,
           "has_post_expert_norm": False}

_INSTEAD = "set parallel.ep=1 (FSDP/HSDP shard the experts too)"

# Each expert-parallel experts module -> its ep mesh (set by apply_expert_parallel).
_EP_MESHES: "weakref.WeakKeyDictionary[nn.Module, DeviceMesh]" = weakref.WeakKeyDictionary()


@lru_cache(maxsize=None)
def _interface_forward_code() -> Any:
    """The code of the ``forward`` that ``@use_experts_implementation`` gives a class (every
    decorated class's forward runs it: the interface's dispatch)."""
    from transformers.integrations.moe import use_experts_implementation

    class Probe(nn.Module):
        def forward(self, hidden_states, top_k_index, top_k_weights):  # never called
            raise NotImplementedError

    return use_experts_implementation(Probe).forward.__code__


def grouped_experts(model: nn.Module) -> Dict[str, nn.Module]:
    """The modules of ``model`` whose forward dispatches through ``transformers``' experts
    interface (``@use_experts_implementation``), by name."""
    code = _interface_forward_code()
    return {name: m for name, m in model.named_modules() if type(m).forward.__code__ is code}


def _layout_problem(name: str, experts: nn.Module) -> str:
    """Why ``experts`` is not the layout :func:`expert_parallel_forward` computes (empty: it is)."""
    # A flag the installed decorator does not set is an option it predates: the default layout.
    flags = {flag: vars(experts).get(flag, value) for flag, value in _LAYOUT.items()}
    odd = [f"{flag}={flags[flag]}" for flag, value in _LAYOUT.items() if flags[flag] != value]
    shapes = {key: tuple(p.shape) for key, p in experts.named_parameters()}
    if not odd and sorted(shapes) == sorted(_WEIGHTS):
        (e, two_i, h), (e2, h2, i) = shapes["gate_up_proj"], shapes["down_proj"]
        if e == e2 and h == h2 and two_i == 2 * i:
            return ""
    what = ", ".join(odd) if odd else f"parameters {shapes}"
    return (f"{name} ({type(experts).__name__}: {what}) are not grouped gate_up_proj [E, 2I, H] / down_proj "
            f"[E, H, I] experts")


def expert_parallel_problems(model: nn.Module, ep: int) -> List[str]:
    """Why the ``transformers`` ``model`` (a :class:`~hyper_parallel.models.hf_causal_lm.CausalLMLogits`,
    meta is fine) cannot split its experts over ``ep`` ranks, one line (empty: it can): no
    experts (a dense model), experts of another layout or outside the experts interface, or a
    number of experts ``ep`` does not divide."""
    name = model.architecture
    experts = grouped_experts(model)
    if not experts:
        leaves = {key.rsplit(".", 1)[-1] for key, _ in model.named_modules()}
        if any("expert" in leaf or "moe" in leaf for leaf in leaves):  # experts of its own kind
            return [f"parallel.ep={ep}: {name}'s experts do not run through transformers' experts interface "
                    f"(@use_experts_implementation with grouped 3-D weights); {_INSTEAD}"]
        return [f"parallel.ep={ep}: {name} has no experts (a dense model); {_INSTEAD}"]
    odd = [problem for key, module in experts.items() if (problem := _layout_problem(key, module))]
    if odd:
        return [f"parallel.ep={ep}: {name}'s experts {odd[0]}; {_INSTEAD}"]
    counts = sorted({module.gate_up_proj.shape[0] for module in experts.values()})
    if any(n % ep for n in counts):
        return [f"parallel.ep={ep} does not divide {name}'s {'/'.join(map(str, counts))} experts per layer "
                f"(each ep rank holds num_experts / ep of them)"]
    return []


def _register() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERT_PARALLEL, expert_parallel_forward)


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> List[nn.Module]:
    """Split every experts module of ``model`` over the 1-D ``ep_mesh`` (its weights DTensors
    ``Shard(0)``; on the meta device too: initialise afterwards) and make
    :data:`EXPERT_PARALLEL` the model's experts implementation. Returns the experts modules
    (for ``fully_shard`` over the rest of the data-parallel ranks).

    Raises:
        ValueError: as :func:`expert_parallel_problems`, or as
            :func:`~hyper_parallel.parallel.expert.distribute_experts`; or ``transformers`` does
            not let the model's experts implementation be set.
    """
    problems = expert_parallel_problems(model, ep_mesh.size())
    if problems:
        raise ValueError(problems[0])
    experts = list(grouped_experts(model).values())
    for module in experts:
        distribute_experts(module, ep_mesh)
        _EP_MESHES[module] = ep_mesh
    _register()
    model.set_experts_implementation(EXPERT_PARALLEL)
    unset = sorted({module.config._experts_implementation for module in experts} - {EXPERT_PARALLEL})
    if unset:
        raise ValueError(f"parallel.ep: {model.architecture} kept experts implementation {unset[0]!r} "
                         f"(transformers cannot set {EXPERT_PARALLEL!r} on it); {_INSTEAD}")
    return experts


def expert_parallel_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """``transformers``' experts-interface function of :data:`EXPERT_PARALLEL`: ``hidden_states``
    ``[tokens, H]``, ``top_k_index`` / ``top_k_weights`` ``[tokens, k]``; returns ``[tokens,
    H]``, each token's ``sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(x_t)``.

    Raises:
        ValueError: ``module`` was not split by :func:`apply_expert_parallel`; or, from every
            rank of the ep group, an expert index outside ``[0, E)`` (see
            :func:`~hyper_parallel.parallel.expert.dispatch_tokens`).
    """
    ep_mesh = _EP_MESHES.get(module)
    gate_up, down = module.gate_up_proj, module.down_proj
    if ep_mesh is None or not isinstance(gate_up, DTensor) or not isinstance(down, DTensor):
        raise ValueError(f"{EXPERT_PARALLEL} experts ({type(module).__name__}) run only on experts split by "
                         "hf_expert_parallel.apply_expert_parallel")
    num_experts, (tokens, top_k), width = gate_up.shape[0], top_k_index.shape, hidden_states.shape[-1]
    pairs = top_k_index.reshape(-1)
    order = torch.argsort(pairs, stable=True)  # the (token, expert) pairs sorted by expert
    # Pairs per expert without a host sync; an index outside [0, E) counts in an extra entry left
    # out, so the counts miss rows, which dispatch_tokens refuses on every rank of the ep group.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=pairs.device)
    outside = (pairs < 0) | (pairs >= num_experts)
    counts.scatter_add_(0, torch.where(outside, num_experts, pairs), torch.ones_like(pairs))
    counts = counts[:num_experts]
    received, routing = dispatch_tokens(hidden_states.index_select(0, order // top_k), counts, ep_mesh, num_experts)
    out = _local_experts(module.act_fn, received, routing.local_counts, gate_up.to_local(), down.to_local())
    back = combine_tokens(out, routing, ep_mesh) * top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return back.index_select(0, inverse).view(tokens, top_k, width).sum(dim=1).to(hidden_states.dtype)


def _local_experts(act_fn: nn.Module, x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    """This rank's experts on their rows (``x`` sorted by local expert, ``counts`` rows each):
    ``down[e] @ (act(gate) * up)`` with ``[gate; up] = gate_up[e] @ x``. Grouped GEMM where
    :func:`~hyper_parallel.models.grouped_experts.expert_matmul` chooses it, else one matmul
    chain per expert with rows (the weights by ``unbind``: each gradient written once)."""
    if expert_matmul(x, gate_up, down) is ExpertMatmul.GROUPED_MM:
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate, up = grouped_mm(x, gate_up.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
        return grouped_mm(act_fn(gate) * up, down.transpose(-2, -1), offs=offsets)
    sizes = counts.tolist()
    rows, gate_ups, downs = x.split(sizes), gate_up.unbind(0), down.unbind(0)
    # With no rows at all, expert 0 runs on the empty rows: the weights still take part in autograd.
    active = [e for e, size in enumerate(sizes) if size] or [0]
    outs = []
    for e in active:
        gate, up = F.linear(rows[e], gate_ups[e]).chunk(2, dim=-1)
        outs.append(F.linear(act_fn(gate) * up, downs[e]))
    return outs[0] if len(outs) == 1 else torch.cat(outs)
