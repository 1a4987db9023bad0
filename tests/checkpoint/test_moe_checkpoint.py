"""Checkpoints of the mixture-of-experts model across expert-parallel layouts, in float64 on 4
gloo ranks: the experts are saved as global ``[num_experts, ...]`` tensors whatever the EP x FSDP
layout, so one save (EP2 x FSDP2, after an AdamW step) loads into EP4, plain FSDP, HSDP and one
process with every parameter and optimizer value equal, and the next step's loss the same."""

from __future__ import annotations

import io
import json
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import hyper_parallel as hp
from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.cli import inspect
from hyper_parallel.models import build_moe, hf_moe
from hyper_parallel.models.moe import MoETransformer
from hyper_parallel.parallel.expert import ExpertParallel, expert_meshes
from tests.checkpoint.helpers import app_state
from tests.multirank import run_on_ranks

WORLD = 4
SEQ, BATCH = 12, 2
LOSS_TOL = 1e-10  # float64: the layouts sum the same products, at most in another order


def meta_moe_float64() -> MoETransformer:
    """moe_debug in float64 on the meta device."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            return build_moe("moe_debug")
    finally:
        torch.set_default_dtype(default)


def build(layout: str, seed: int) -> MoETransformer:
    """moe_debug in float64 under ``layout``: "ep4" / "ep2" (experts Shard(0) over ep, FSDP over
    the other ranks, dense FSDP over all), "fsdp" (every rank), "hsdp" (2 x 2) or "single"."""
    model = meta_moe_float64()
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))
        for block in model.layers.values():
            hp.fully_shard(block, mesh=mesh)
        hp.fully_shard(model, mesh=mesh)
    elif layout != "single":
        ep = {"ep4": 4, "ep2": 2, "fsdp": 1}[layout]
        dp_shard = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
        for block in model.layers.values():
            if ep > 1:
                ep_mesh, efsdp_mesh = expert_meshes(dp_shard, ep)
                parallelize_module(block.moe.experts, ep_mesh, ExpertParallel())
                hp.fully_shard(block.moe.experts, mesh=efsdp_mesh)
                block.moe.experts.set_gradient_divide_factor(WORLD)
            hp.fully_shard(block, mesh=dp_shard)
        hp.fully_shard(model, mesh=dp_shard)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def _tokens(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(model: MoETransformer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    # model.aux_loss() is detached (the value); its gradients come with the logits' backward.
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + model.aux_loss()


def train_step(model: MoETransformer, optim: Optional[torch.optim.Optimizer], step: int) -> float:
    """One step on the global batch (each rank its own tokens; one process: the 4 ranks' batches
    as micro-batches): the mean over the ranks of their loss. ``optim`` None: forward only."""
    if dist.is_initialized():
        ranks = [dist.get_rank()]
    else:
        ranks = list(range(WORLD))
    total = torch.zeros((), dtype=torch.float64)
    model.set_aux_loss_scale(1 / len(ranks))  # the scale of each loss below
    for rank in ranks:
        loss = _loss(model, _tokens(rank, step)) / len(ranks)
        if optim is not None:
            loss.backward()
        total += loss.detach()
    if dist.is_initialized():
        dist.all_reduce(total)
        total /= WORLD
    if optim is not None:
        optim.step()
        optim.zero_grad()
    return total.item()


def full_state(model: MoETransformer, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    """The resolved model + optimizer state, flat, every DTensor gathered (a collective)."""
    flat = hdcp.flatten_state_dict({k: v.state_dict() for k, v in app_state(model, optim).items()})[0]
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v.clone() if isinstance(v, torch.Tensor) else v)
            for k, v in flat.items()}


def _save_source(path: str, layout: str) -> Tuple[Optional[Dict[str, Any]], float, List[str]]:
    model = build(layout, seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, optim, step=1)
    hdcp.save(app_state(model, optim), checkpoint_id=path)
    w1 = model.layers["0"].moe.experts.w1
    local = [str(p) for p in w1.placements] + [f"local {tuple(w1.to_local().shape)}"]
    state = full_state(model, optim)
    train_step(model, optim, step=2)
    return (state if dist.get_rank() == 0 else None), train_step(model, None, step=3), local


def load_and_continue(path: str, layout: str) -> Tuple[Optional[Dict[str, Any]], float]:
    """Load ``path`` into ``layout`` (another init seed, a fresh AdamW): its full state, then the
    loss after one more step."""
    model = build(layout, seed=7)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hdcp.load(app_state(model, optim), checkpoint_id=path, no_dist=layout == "single")
    state = full_state(model, optim)
    train_step(model, optim, step=2)
    rank = dist.get_rank() if dist.is_initialized() else 0
    return (state if rank == 0 else None), train_step(model, None, step=3)


def assert_exactly_equal(actual: Dict[str, Any], expected: Dict[str, Any], layout: str) -> None:
    assert actual.keys() == expected.keys(), (layout, sorted(actual.keys() ^ expected.keys()))
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), (layout, key)
        else:
            assert actual[key] == value, (layout, key, actual[key], value)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """EP2 x FSDP2 after one AdamW step, saved: (path, full state, loss after one more step)."""
    path = str(tmp_path_factory.mktemp("moe") / "step-1")
    results = run_on_ranks(WORLD, _save_source, path, "ep2", timeout=120)
    # (efsdp, ep) mesh: each rank holds 2 of the 8 experts
    assert [r[2] for r in results] == [["_S(0, 2)", "S(0)", "local (2, 64, 32)"]] * WORLD
    return path, results[0][0], results[0][1]


def test_experts_are_saved_as_global_tensors(source):
    path, state, _ = source
    metadata = hdcp.read_checkpoint_metadata(path)
    for name in ("w1", "w2", "w3"):
        key = f"model.layers.1.moe.experts.{name}"
        assert tuple(metadata.state_dict_metadata[key].size) == tuple(state[key].shape), key
        assert state[key].shape[0] == 8, key
        assert tuple(metadata.state_dict_metadata[f"optim.state.{key[6:]}.exp_avg"].size) == tuple(state[key].shape)
    assert any(state[k].abs().max() > 0 for k in state if k.endswith("experts.w1.exp_avg"))


def test_inspect_shows_the_experts_save_time_mesh_and_placements(source):
    out = io.StringIO()
    inspect(source[0], out)
    lines = {line.split()[0]: line for line in out.getvalue().splitlines() if line.startswith("  ")}
    for key in ("model.layers.1.moe.experts.w2", "optim.state.layers.1.moe.experts.w2.exp_avg"):
        assert "8x32x64" in lines[key] and "4 chunk(s)" in lines[key], lines[key]
        assert lines[key].endswith("mesh 2x2 (efsdp,ep) placements [_S(0, 2),S(0)]"), lines[key]
    assert lines["model.layers.1.moe.router.gate.weight"].endswith("mesh 4 (dp_shard) placements [S(0)]")


@pytest.mark.parametrize("layout", ["ep4", "fsdp", "hsdp", "ep2"])
def test_an_ep2_checkpoint_loads_into_other_layouts_exactly(source, layout):
    path, expected, loss = source
    results = run_on_ranks(WORLD, load_and_continue, path, layout, timeout=120)
    assert_exactly_equal(results[0][0], expected, layout)
    for rank, (_, rank_loss) in enumerate(results):
        assert abs(rank_loss - loss) <= LOSS_TOL * abs(loss), (layout, rank, rank_loss, loss)


def test_an_ep2_checkpoint_loads_into_one_process_exactly(source):
    path, expected, loss = source
    state, single_loss = load_and_continue(path, "single")
    assert_exactly_equal(state, expected, "single")
    assert abs(single_loss - loss) <= LOSS_TOL * abs(loss), (single_loss, loss)


def test_an_ep2_checkpoint_exports_to_transformers_with_the_same_logits(source, tmp_path):
    transformers = pytest.importorskip("transformers")
    path, expected, _ = source
    model = build("single", seed=7)
    hdcp.load({"model": hdcp.ModelState(model)}, checkpoint_id=path, no_dist=True)
    assert torch.equal(model.layers["1"].moe.experts.w3.detach(), expected["model.layers.1.moe.experts.w3"])
    cfg = model.cfg
    index = hdcp.export_hf(path, tmp_path / "hf", convert=lambda n, t: hf_moe.to_hf(n, t, cfg))
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in index["weight_map"]  # one tensor per expert
    # config.json names float32 (its dtype names stop there); the float64 weights load as float64
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_moe.hf_config(cfg, torch.float32)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64,
                                                             experts_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and hf.dtype == torch.float64
    tokens = torch.cat([_tokens(rank, step=4) for rank in range(WORLD)])
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    # transformers takes the router's softmax and the rotary tables in float32: float32 agreement
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_a_moe_layout_mismatch_names_the_first_keys_not_every_one():
    """A model of 40 MoE blocks without the checkpoint's shared experts differs in 120 keys:
    the error names the first few and the count, in a bounded line."""
    saved = hdcp.get_model_state_dict(build_moe("moe_debug", n_layers=40, shared_experts=1))
    with pytest.raises(KeyError) as raised:
        hdcp.set_model_state_dict(build_moe("moe_debug", n_layers=40), saved)
    message = str(raised.value)
    assert "unexpected keys ['layers.0.moe.shared_expert.w1.weight', " in message, message
    assert "(120 in all)" in message and len(message) < 1000, message
