"""torchao float8 training under fully_shard (2-4 gloo ranks): the all-gather extension protocol
(fsdp_pre/post_all_gather) against torch's fully_shard, float8 bytes on the wire, checkpoints."""

from __future__ import annotations

import contextlib
import math
import tempfile
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

import hyper_parallel as hp
from hyper_parallel._torch_compat import local_tensor
from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.fully_shard import collectives
from tests.multirank import run_on_ranks

torchao_float8 = pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install "
                                     "'hyper_parallel[float8]'): float8 training tests skipped")

IN, HIDDEN, OUT = 32, 64, 16  # float8 matmuls need dims divisible by 16
STEPS = 3


def _model(float8_all_gather: bool, hidden: int = HIDDEN, bf16_values: bool = False) -> nn.Module:
    """Two float8 linears and a high-precision output layer (filtered out, as torchtitan does);
    ``bf16_values``: fp32 parameters holding bf16-representable values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(IN, hidden), nn.ReLU(), nn.Linear(hidden, IN, bias=False), nn.ReLU(),
                          nn.Linear(IN, OUT))
    if bf16_values:
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.bfloat16())
    config = torchao_float8.Float8LinearConfig(enable_fsdp_float8_all_gather=float8_all_gather)
    return torchao_float8.convert_to_float8_training(model, config=config,
                                                     module_filter_fn=lambda mod, fqn: fqn != "4")


def _batch(step: int, rank: int, world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(8 * world, IN, generator=gen).chunk(world)[rank]


def _train(model: nn.Module, rank: int, world: int, precompute: bool = False, steps: int = STEPS,
           record: Optional[list] = None):
    """Train; ``record``: the first step's all-gather inputs are appended to it."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        with _recorded_gathers(record if step == 0 else None):
            loss = (model(_batch(step, rank, world)) ** 2).mean()
            loss.backward()
        opt.step()
        opt.zero_grad()
        if precompute:
            torchao_float8.precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.item())
    return losses


def _full(model: nn.Module):
    return {k.replace(".block.", "."): (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone().float()
            for k, v in model.state_dict().items()}


class _Checkpointed(nn.Module):
    """Runs a (sharded) block under non-reentrant activation checkpointing."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def _wrap(model: nn.Module, shard, checkpointed: bool = False, compiled: bool = False, **kw) -> nn.Module:
    for i in (0, 2):
        if compiled:  # per-block compile (fully_shard's hooks stay eager around it)
            model[i].compile(backend="aot_eager", fullgraph=True)
        shard(model[i], **kw)
        if checkpointed:
            model[i] = _Checkpointed(model[i])
    return shard(model, **kw)


def _float8_weight_numel(model: nn.Module, world: int) -> int:
    """Elements of this rank's padded shards of the float8 weights (same on either shard dim
    for these shapes)."""
    layers = [getattr(model[i], "block", model[i]) for i in (0, 2)]
    return sum(math.ceil(m.weight.shape[0] / world) * m.weight.shape[1] for m in layers)


def _parity_with_torch(hidden: int = HIDDEN, mesh_shape=None, precompute: bool = False, steps: int = STEPS,
                       bf16_values: bool = False, param_dtype: Optional[torch.dtype] = None,
                       checkpointed: bool = False, compiled: bool = False, ours_kw: Optional[dict] = None,
                       **kw):
    """Our fully_shard (float8 gather) vs torch's (full-precision gather: its float8 gather
    cannot run on gloo) on the same torchao model; returns (ours, torch's) losses and params,
    and the uint8 all-gather bytes of the first step over the float8 shard elements."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("rep", "shard")) if mesh_shape else None
    shard_world = mesh_shape[1] if mesh_shape else world
    reference = _wrap(_model(False, hidden, bf16_values), torch.distributed.fsdp.fully_shard, mesh=mesh,
                      mp_policy=torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=param_dtype),
                      checkpointed=checkpointed, compiled=compiled, **kw)
    ref_losses = _train(reference, rank, world, steps=steps)
    ours = _wrap(_model(True, hidden, bf16_values), hp.fully_shard, mesh=mesh, checkpointed=checkpointed,
                 compiled=compiled,
                 mp_policy=hp.MixedPrecisionPolicy(param_dtype=param_dtype), **kw, **(ours_kw or {}))
    inputs = []
    losses = _train(ours, rank, world, precompute=precompute, steps=steps, record=inputs)
    if precompute:  # torchao's one-all-reduce scales apply to our sharded parameters
        assert all(local_tensor(getattr(ours[i], "block", ours[i]).weight)._precomputed_scale is not None
                   for i in (0, 2))
    # Each float8 layer is gathered as often as the other (forward, and backward unless kept).
    float8 = [numel for dtype, numel in inputs if dtype == torch.uint8]
    ratio = sum(float8) / (len(float8) // 2 * _float8_weight_numel(ours, shard_world)) if float8 else 0.0
    return losses, ref_losses, _full(ours), _full(reference), ratio, len(float8)


@contextlib.contextmanager
def _recorded_gathers(inputs: Optional[list]):
    """Append (dtype, numel) of every all-gather input fully_shard issues inside the block."""
    original = collectives.all_gather
    if inputs is None:
        yield
        return

    def recording(output, shard, group, async_op):
        inputs.append((shard.dtype, shard.numel()))
        return original(output, shard, group, async_op)
    collectives.all_gather = recording
    try:
        yield
    finally:
        collectives.all_gather = original


def _check(result, rtol: float = 1e-5):
    losses, ref_losses, params, ref_params, ratio, gathers = result
    assert gathers > 0, "no float8 (uint8) all-gather"
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= rtol * abs(b), (losses, ref_losses)
    for name in ref_params:
        torch.testing.assert_close(params[name], ref_params[name], rtol=rtol, atol=rtol / 10, msg=name)
    # The float8 layers' gathers carry 1 byte per weight element (the fsdp_pre_all_gather
    # output): removing the protocol call leaves no uint8 all-gather at all.
    assert ratio == 1.0, ratio


def _variants():
    out = {"plain": _parity_with_torch()}
    # Scales of all float8 weights from one all-reduce after the optimizer step (torchao).
    out["precomputed_scales"] = _parity_with_torch(precompute=True)
    out["no_reshard"] = _parity_with_torch(reshard_after_forward=False)
    # bf16 compute: torch's full-precision gather casts the fp32 weight to bf16, then to float8;
    # the float8 gather (ours, as torch's own) casts fp32 to float8. One step from
    # bf16-representable weights makes the two paths see the same values.
    out["mixed_precision"] = _parity_with_torch(param_dtype=torch.bfloat16, steps=1, bf16_values=True)
    out["activation_checkpointing"] = _parity_with_torch(checkpointed=True)
    out["cpu_offload"] = _parity_with_torch(ours_kw=dict(offload_policy=hp.CPUOffloadPolicy()))
    out["shard_dim1"] = _parity_with_torch(ours_kw=dict(shard_placement_fn=lambda p: Shard(p.ndim - 1)))
    return out


def test_float8_matches_torch_fully_shard():
    for result in run_on_ranks(2, _variants, timeout=240):
        for name, value in result.items():
            _check(value)


def _compiled():
    return {"compiled": _parity_with_torch(compiled=True, steps=2)}


def _uneven():
    return {"uneven": _parity_with_torch(hidden=32)}  # 32 rows over 3 ranks: 11, 11, 10


def _hsdp():
    with pytest.raises(ValueError, match=r"reshard_after_forward=2 \(an int\) is not supported"):
        hp.fully_shard(_model(True)[0], reshard_after_forward=2)  # 4 ranks: post-forward pairs
    return {"hsdp": _parity_with_torch(mesh_shape=(2, 2))}


@pytest.mark.parametrize("world, variants", [(3, _uneven), (4, _hsdp), (2, _compiled)],
                         ids=["uneven", "hsdp", "compiled"])
def test_float8_uneven_hsdp_compiled(world, variants):
    for result in run_on_ranks(world, variants, timeout=240):
        for value in result.values():
            _check(value)


def _plain_model() -> nn.Module:
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, IN, bias=False), nn.ReLU(),
                         nn.Linear(IN, OUT))


def _checkpoint_round_trip(root: str):
    """A float8-trained checkpoint resumes without float8, and that one's checkpoint with float8:
    the state dicts hold the high-precision weights."""
    rank, world = dist.get_rank(), dist.get_world_size()
    float8 = _wrap(_model(True), hp.fully_shard)
    inputs = []
    _train(float8, rank, world, steps=2, record=inputs)
    assert any(dtype == torch.uint8 for dtype, _ in inputs)
    hdcp.save({"model": float8.state_dict()}, checkpoint_id=f"{root}/float8")
    plain = _wrap(_plain_model(), hp.fully_shard)
    state = {"model": plain.state_dict()}
    hdcp.load(state, checkpoint_id=f"{root}/float8")
    plain.load_state_dict(state["model"])
    diffs = [max((a - _full(float8)[k]).abs().max().item() for k, a in _full(plain).items())]
    _train(plain, rank, world, steps=1)
    hdcp.save({"model": plain.state_dict()}, checkpoint_id=f"{root}/plain")
    resumed = _wrap(_model(True), hp.fully_shard)
    state = {"model": resumed.state_dict()}
    hdcp.load(state, checkpoint_id=f"{root}/plain")
    resumed.load_state_dict(state["model"])
    assert all(type(m.weight.to_local()).__name__ == "WeightWithDynamicFloat8CastTensor"
               for m in (resumed[0], resumed[2]))
    diffs.append(max((a - _full(plain)[k]).abs().max().item() for k, a in _full(resumed).items()))
    # The resumed float8 model trains (its next gather is float8 again) like the plain one would;
    # so does one given the plain model's DTensors with load_state_dict(assign=True).
    assigned = _wrap(_model(True), hp.fully_shard)
    assigned.load_state_dict({k: v.detach().clone() for k, v in plain.state_dict().items()}, assign=True)
    for model in (resumed, assigned):
        inputs = []
        _train(model, rank, world, steps=1, record=inputs)
        assert any(dtype == torch.uint8 for dtype, _ in inputs)
    diffs.append(max((a - _full(resumed)[k]).abs().max().item() for k, a in _full(assigned).items()))
    return diffs


def test_float8_checkpoint_resumes_without_float8_and_back(tmp_path):
    for diffs in run_on_ranks(2, _checkpoint_round_trip, str(tmp_path), timeout=120):
        assert diffs == [0.0, 0.0, 0.0], diffs
