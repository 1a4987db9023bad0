"""Per-parameter meshes (``shard_placement_fn`` returning torch's ``ShardPlacementResult``):
expert-like 3-D parameters shard over an expert mesh while the dense ones shard over the
call's mesh, on 4 gloo ranks in float64, against torch's own ``fully_shard`` and against
single-process training."""

from __future__ import annotations

import copy
from typing import Callable, Dict, List
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

import hyper_parallel as hp
from hyper_parallel.core.fully_shard import HSDPMeshInfo, ShardPlacementResult, collectives, shard_on
from tests.fully_shard._helpers import DTYPE, TOL, full_params, max_diff, train
from tests.multirank import run_on_ranks

DIM, EXPERTS, HIDDEN = 6, 4, 4  # even on every dim over 2 ranks (torch refuses uneven Shard(1))


class _Experts(nn.Module):
    """Routed experts as 3-D parameters (dim 0 = expert), every token through every expert."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * 0.4)
        self.w2 = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.einsum("td,edh->teh", x, self.w1).tanh()
        return torch.einsum("teh,ehd->ted", hidden, self.w2)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = _Experts()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.router(x).softmax(-1).unsqueeze(-1)
        return x + self.proj((gate * self.experts(x)).sum(1))


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, DIM)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.out = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Model().to(DTYPE)


def _batches(steps: int = 2, size: int = 8) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(size, 7, generator=gen, dtype=DTYPE) for _ in range(steps)]


def _mse(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(batch[:, :4]), batch[:, 4:])


def _meshes():
    """Dense: 1-D over the 4 ranks; experts: 2x2 (replicate, shard), and its 1-D shard rows."""
    dense = hp.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    experts = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("erep", "efsdp"))
    return dense, experts


def _shard(shard: Callable, model: nn.Module, mesh, expert: ShardPlacementResult, **kw) -> nn.Module:
    """``shard`` (ours or torch's fully_shard) on each block, experts on ``expert``'s mesh, then the root."""
    for layer in model.layers:
        expert_params = set(layer.experts.parameters())
        shard(layer, mesh=mesh, shard_placement_fn=lambda p, e=expert_params: expert if p in e else None, **kw)
    return shard(model, mesh=mesh, **kw)


def _grads(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


# -- against torch's fully_shard --------------------------------------------------------------
def _versus_torch(variant: str) -> Dict[str, float]:
    dense, experts = _meshes()
    kw = {}
    if variant == "hsdp_experts":
        expert = shard_on(experts)
    elif variant == "fsdp_expert_rows":  # 1-D meshes of 2 ranks ({0, 1} and {2, 3})
        expert = shard_on(experts["efsdp"])
    elif variant == "shard_dim1_mixed_precision":
        expert = shard_on(experts, Shard(1))
        kw = {"mp_policy": TorchMixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float64)}
    ours = _shard(hp.fully_shard, _model(), dense, expert, **kw)
    theirs = _shard(torch_fully_shard, _model(), dense, expert, **kw)
    for (name, mine), other in zip(ours.named_parameters(), theirs.parameters()):
        assert (mine.device_mesh, mine.placements) == (other.device_mesh, other.placements), name
    rank = dist.get_rank()
    result = {"loss": 0.0, "grad": 0.0}
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    for batch in _batches():
        losses = [_mse(m, batch.chunk(4)[rank]) for m in (ours, theirs)]
        for loss in losses:
            loss.backward()
        result["loss"] = max(result["loss"], abs(losses[0].item() - losses[1].item()))
        result["grad"] = max(result["grad"], max_diff(_grads(ours), _grads(theirs)))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    result["params"] = max_diff(full_params(ours), full_params(theirs))
    return result


@pytest.mark.parametrize("variant", ["hsdp_experts", "fsdp_expert_rows", "shard_dim1_mixed_precision"])
def test_matches_torch_fully_shard(variant):
    for result in run_on_ranks(4, _versus_torch, variant, timeout=240):
        assert max(result.values()) < 1e-12, result


# -- against single-process training ----------------------------------------------------------
def _parity(wrap: Callable[[nn.Module], nn.Module], micro_batches: int = 1,
            before_micro=None, clip: bool = False) -> float:
    rank = dist.get_rank()
    reference = _model()
    model = wrap(copy.deepcopy(reference))
    batches = _batches(size=8 * micro_batches)
    norms = []

    def step_fn(m):
        def make(params):
            opt = torch.optim.AdamW(params, lr=1e-2)
            step = opt.step

            def clipped_step():
                norms.append(hp.clip_grad_norm_(m.parameters(), 0.05).item())
                step()
            if clip:
                opt.step = clipped_step
            return opt
        return make

    train(reference, batches, loss_fn=_mse, micro_batches=micro_batches, make_optimizer=step_fn(reference))
    train(model, [b.chunk(4)[rank] for b in batches], loss_fn=_mse, micro_batches=micro_batches,
          before_micro=before_micro, make_optimizer=step_fn(model))
    diff = max_diff(full_params(model), full_params(reference))
    if clip:  # the reference's norms first, then ours
        half = len(norms) // 2
        diff = max([diff] + [abs(a - b) for a, b in zip(norms[:half], norms[half:])])
    return diff


def _versus_single_process() -> Dict[str, float]:
    dense, experts = _meshes()
    expert = shard_on(experts)
    wrap = lambda **kw: lambda m: _shard(hp.fully_shard, m, dense, expert, **kw)  # noqa: E731

    def no_sync_first(model, micro, n_micro):
        model.set_requires_gradient_sync(micro == n_micro - 1)

    def on_meta(model):
        with torch.device("meta"):
            empty = _Model().to(DTYPE)
        _shard(hp.fully_shard, empty, dense, expert)
        empty.to_empty(device="cpu")
        empty.load_state_dict(model.state_dict())  # full tensors: each rank keeps its shards
        return empty

    def prefetched(model):
        _shard(hp.fully_shard, model, dense, expert)
        first, second = model.layers
        first.set_modules_to_forward_prefetch([second])
        second.set_modules_to_backward_prefetch([first])
        return model

    return {
        "plain_and_clip": _parity(wrap(), clip=True),
        "accumulation": _parity(wrap(), micro_batches=2, before_micro=no_sync_first),
        "cpu_offload": _parity(wrap(offload_policy=hp.CPUOffloadPolicy(pin_memory=False))),
        "reshard_to_pairs": _parity(wrap(reshard_after_forward=2)),
        "meta_init": _parity(on_meta),
        "prefetch": _parity(prefetched),
    }


def test_matches_single_process_training():
    for result in run_on_ranks(4, _versus_single_process, timeout=300):
        bad = {k: v for k, v in result.items() if not v <= TOL}
        assert not bad, result


# -- collectives, layout, state_dict, errors --------------------------------------------------
def _one_collective_per_mesh() -> dict:
    dense, experts = _meshes()
    model = _shard(hp.fully_shard, _model(), dense, shard_on(experts))
    block = model.layers[0]
    assert [len(sub.buckets) for sub in block._state.group.meshes] == [1, 1]
    w1, proj = block.experts.w1, block.proj.weight
    assert w1.device_mesh == experts and w1.placements == (Replicate(), Shard(0)), w1.placements
    assert proj.device_mesh == dense and proj.placements == (Shard(0),)
    events = []

    def recording(name, real):
        def call(*args, group=None, async_op=False, **kwargs):
            size = dist.get_world_size(group)
            work = real(*args, group=group, async_op=async_op, **kwargs)
            events.append((name, size))
            if work is None:
                return None
            wait = work.wait
            work_proxy = mock.Mock(wraps=work)
            work_proxy.wait = lambda *a: (events.append(("wait " + name, size)), wait(*a))[1]
            return work_proxy
        return call

    batch = _batches()[0].chunk(4)[dist.get_rank()]
    with mock.patch.object(dist, "all_gather_single", recording("all_gather", dist.all_gather_single)), \
            mock.patch.object(dist, "reduce_scatter_single", recording("reduce_scatter", dist.reduce_scatter_single)):
        block.unshard()
        gathers = list(events)
        block.reshard()
        events.clear()
        _mse(model, batch).backward()
    reductions = [e for e in events if "reduce_scatter" in e[0]]
    return {"gathers": gathers, "reductions": reductions[:4],
            "state_dict": {k: (v.device_mesh.mesh_dim_names, v.placements) for k, v in model.state_dict().items()
                           if k.startswith("layers.0.")}}


def test_one_all_gather_and_reduce_scatter_per_mesh_issued_together():
    for result in run_on_ranks(4, _one_collective_per_mesh, timeout=120):
        # Both meshes' all-gathers (4 ranks, then 2) are issued before either is waited for,
        # and so are the reduce-scatters of one block's backward.
        assert result["gathers"] == [("all_gather", 4), ("all_gather", 2),
                                     ("wait all_gather", 4), ("wait all_gather", 2)], result["gathers"]
        assert result["reductions"] == [("reduce_scatter", 4), ("reduce_scatter", 2),
                                        ("wait reduce_scatter", 4), ("wait reduce_scatter", 2)], result
        placements = result["state_dict"]
        assert placements["layers.0.experts.w1"] == (("erep", "efsdp"), (Replicate(), Shard(0))), placements
        assert placements["layers.0.router.weight"] == (("dp",), (Shard(0),)), placements


def _errors() -> Dict[str, str]:
    dense, experts = _meshes()
    messages = {}

    def expect(key, fn):
        with pytest.raises(ValueError) as info:
            fn()
        messages[key] = str(info.value)

    def shard_block(result, **kw):
        block = _Block().to(DTYPE)
        hp.fully_shard(block, mesh=dense, shard_placement_fn=lambda p: result if p.ndim == 3 else None, **kw)

    expect("fsdp_info_on_2d", lambda: shard_block(ShardPlacementResult(Shard(0), HSDPMeshInfo(
        mesh=experts, shard_mesh_dim=0, replicate_mesh_dim=1))))
    expect("placement", lambda: shard_block(ShardPlacementResult(Replicate(), shard_on(experts).mesh_info)))
    expect("reshard_int", lambda: shard_block(shard_on(experts["efsdp"]), reshard_after_forward=4))
    expect("shard_on_3d", lambda: shard_on(hp.init_device_mesh("cpu", (2, 2, 1))))
    return messages


def test_bad_placements_are_refused_naming_the_parameter():
    messages = run_on_ranks(4, _errors, timeout=120)[0]
    assert "experts.w1" in messages["fsdp_info_on_2d"] and "replicate_mesh_dim=0" in messages["fsdp_info_on_2d"]
    assert "experts.w1" in messages["placement"] and "Replicate" in messages["placement"]
    assert "reshard_after_forward=4 must divide the shard world size 2 of the parameters' mesh" \
        in messages["reshard_int"], messages
    assert "1-D (FSDP) or 2-D" in messages["shard_on_3d"]
