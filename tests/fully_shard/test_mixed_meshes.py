"""Per-parameter meshes (experts on their own mesh, the dense parameters on the data mesh) with
per-block ``torch.compile`` (``aot_eager``) and with torchao float8 on the dense linears, on 4
gloo ranks.

Compiled runs are compared in float64 with the same model eager (and with single-process
training); float8 runs with the same float8 conversion without the expert mesh, and with
torch's own ``fully_shard`` on the same meshes, as tests/fully_shard/test_float8.py does.
"""

from __future__ import annotations

import copy
from typing import Callable, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import hyper_parallel as hp
from hyper_parallel.core.fully_shard import ShardPlacementResult, collectives, shard_on
from tests.fully_shard._helpers import CountingBackend, full_params, max_diff, train
from tests.fully_shard.test_per_param_mesh import _Block, _Model, _batches, _meshes, _model, _mse
from tests.multirank import run_on_ranks

TOL = 1e-10  # float64, compiled vs eager: only the summation order may differ


def _shard(shard: Callable, model: nn.Module, mesh, expert: Optional[ShardPlacementResult], *,
           compile_backend=None) -> nn.Module:
    """Compile each block (``compile_backend``; fullgraph) and ``shard`` it, its ``experts``
    on ``expert``'s mesh (None: on ``mesh`` too), then the root (the torchtitan order)."""
    for layer in model.layers:
        if compile_backend is not None:
            layer.compile(backend=compile_backend, fullgraph=True)
        experts = set(layer.experts.parameters())
        place = (lambda p, e=experts: expert if p in e else None) if expert is not None else None
        shard(layer, mesh=mesh, shard_placement_fn=place)
    return shard(model, mesh=mesh)


# -- compile, float64 -------------------------------------------------------------------------
def _compiled_versus_eager() -> Dict[str, float]:
    rank = dist.get_rank()
    dense, experts = _meshes()
    batches = _batches(steps=3)
    reference = _model()
    train(reference, batches, loss_fn=_mse)
    out = {}
    backend = CountingBackend("aot_eager")  # one backend: the second layout reuses dynamo's cache
    for name, expert in (("hsdp_experts", shard_on(experts)), ("fsdp_expert_rows", shard_on(experts["efsdp"]))):
        calls, runs = backend.calls, {}
        for mode in ("eager", "compiled"):
            model = _shard(hp.fully_shard, _model(), dense, expert,
                           compile_backend=backend if mode == "compiled" else None)
            losses = train(model, [b.chunk(4)[rank] for b in batches], loss_fn=_mse)
            runs[mode] = (losses, full_params(model))
        assert backend.calls - calls >= 2 * 3, backend.calls  # 2 blocks x 3 steps ran compiled
        (eager_losses, eager_params), (losses, params) = runs["eager"], runs["compiled"]
        out[f"{name}: losses"] = max(abs(a - b) for a, b in zip(losses, eager_losses))
        out[f"{name}: params vs eager"] = max_diff(params, eager_params)
        if name == "hsdp_experts":  # (the expert rows average expert gradients over 2 ranks, not 4)
            out[f"{name}: params vs one process"] = max_diff(params, full_params(reference))
    return out


def test_compiled_blocks_with_an_expert_mesh_match_eager_and_one_process():
    for result in run_on_ranks(4, _compiled_versus_eager, timeout=300):
        bad = {k: v for k, v in result.items() if not v <= TOL}
        assert not bad, f"max abs diff above {TOL}: {bad}"


# -- float8 on the dense linears --------------------------------------------------------------
F8_DIM, F8_EXPERTS, F8_HIDDEN = 32, 4, 16  # float8 matmuls need sizes that are multiples of 16
F8_RTOL = 1e-5  # float32 with float8 matmuls: the same quantisation, another summation order


class _F8Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(F8_EXPERTS, F8_DIM, F8_HIDDEN) * 0.2)
        self.w2 = nn.Parameter(torch.randn(F8_EXPERTS, F8_HIDDEN, F8_DIM) * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("teh,ehd->ted", torch.einsum("td,edh->teh", x, self.w1).tanh(), self.w2)


class _F8Block(_Block):
    """A router (32 -> 4: stays high precision), experts, and a 32 x 32 float8 projection."""

    def __init__(self):
        nn.Module.__init__(self)
        self.router = nn.Linear(F8_DIM, F8_EXPERTS)
        self.experts = _F8Experts()
        self.proj = nn.Linear(F8_DIM, F8_DIM)


class _F8Model(_Model):
    def __init__(self):
        nn.Module.__init__(self)
        self.inp = nn.Linear(16, F8_DIM)
        self.layers = nn.ModuleList([_F8Block(), _F8Block()])
        self.out = nn.Linear(F8_DIM, 16)


def _f8_model(float8_all_gather: bool) -> nn.Module:
    """Float32, the eligible dense linears converted as ``training.float8`` does (tensorwise)."""
    from hyper_parallel.models.float8 import convert_to_float8

    torch.manual_seed(0)
    model = _F8Model()
    convert_to_float8(model, "tensorwise", float8_all_gather=float8_all_gather)
    return model


def _f8_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(batch[:, :16]), batch[:, 16:])


def _f8_run(shard: Callable, expert: Optional[ShardPlacementResult], float8_all_gather: bool = True,
            compile_backend=None) -> tuple:
    """Losses and full parameters of 3 AdamW steps on one batch, and the dtypes of every all-gather input."""
    rank, (dense, _) = dist.get_rank(), _meshes()
    model = _shard(shard, _f8_model(float8_all_gather), dense, expert, compile_backend=compile_backend)
    batches = [torch.randn(16, 32, generator=torch.Generator().manual_seed(5)).chunk(4)[rank]] * 3
    gathered: List[torch.dtype] = []
    original = collectives.all_gather

    def recording(output, shard_, group, async_op):
        gathered.append(shard_.dtype)
        return original(output, shard_, group, async_op)
    collectives.all_gather = recording
    try:
        losses = train(model, batches, loss_fn=_f8_loss)
    finally:
        collectives.all_gather = original
    return losses, {k: v.float() for k, v in full_params(model).items()}, gathered


def _float8_with_an_expert_mesh() -> Dict[str, object]:
    pytest.importorskip("torchao.float8")
    _, experts = _meshes()
    expert = shard_on(experts)
    losses, params, gathered = _f8_run(hp.fully_shard, expert)
    backend = CountingBackend("aot_eager")
    compiled_losses, compiled_params, _ = _f8_run(hp.fully_shard, expert, compile_backend=backend)
    runs = {"no expert mesh": _f8_run(hp.fully_shard, None),
            # torch's fully_shard cannot gather float8 on gloo: it gathers the weights in float32
            "torch fully_shard": _f8_run(torch_fully_shard, expert, float8_all_gather=False),
            "compiled": (compiled_losses, compiled_params, None)}
    out: Dict[str, object] = {"uint8 gathers": gathered.count(torch.uint8), "compiled calls": backend.calls}
    for name, (other_losses, other_params, _) in runs.items():
        out[f"{name}: losses"] = max(abs(a - b) / abs(b) for a, b in zip(losses, other_losses))
        out[f"{name}: params"] = max((params[k] - other_params[k]).abs().max().item() for k in params)
    out["loss fell"] = losses[-1] < losses[0]
    return out


def test_float8_dense_linears_with_experts_on_their_own_mesh():
    """Float8 gathers happen (the two float8 projections, forward and backward, 3 steps), and
    the losses and parameters are those of the same float8 model without the expert mesh, of
    torch's fully_shard on the same meshes, and of the same model compiled per block."""
    for result in run_on_ranks(4, _float8_with_an_expert_mesh, timeout=300):
        assert result.pop("uint8 gathers") >= 2 * 2 * 3, result
        assert result.pop("compiled calls") >= 2 * 3, result
        assert result.pop("loss fell") is True
        bad = {k: v for k, v in result.items() if not v <= F8_RTOL}
        assert not bad, f"above {F8_RTOL}: {bad}"
