"""torchtitan MoE checkpoints (its Qwen3 / DeepSeek-V3 ``MoE`` layer) into our MoETransformer:
a DCP checkpoint with torchtitan's key names (written here by ``torch.distributed.checkpoint.save``,
torchtitan not needed) is imported with the documented renames and loads into our model and
AdamW, every tensor equal.

torchtitan's names (``torchtitan/models/moe/moe.py``): ``layers.N.moe.router.gate.weight``,
``layers.N.moe.experts.w1`` / ``w3`` ``[num_experts, hidden_dim, dim]`` and ``w2``
``[num_experts, dim, hidden_dim]`` (ours have the same shapes), ``layers.N.moe.shared_experts.w1.weight``
(ours: ``shared_expert``), the persistent buffer ``layers.N.moe.expert_bias`` (ours: in the
router, ``moe.router.expert_bias``) and, in older torchtitan versions, a persistent
``layers.N.moe.tokens_per_expert`` (ours is not persistent: left out).
"""

import os
import re
import zlib

import torch
import torch.distributed.checkpoint as torch_dcp

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.cli import main
from hyper_parallel.models.moe import build_moe
from tests.checkpoint.test_dcp_torchtitan import TITAN_MAPPING, TITAN_STATES

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                   "docs", "checkpoint.md")
# The MoE rules docs/checkpoint.md adds before torchtitan's Llama rules (the first match wins).
TITAN_MOE = [
    "--exclude", "layers.*.moe.tokens_per_expert",
    "--rename", "optimizer.state.layers.*.moe.shared_experts.=optim.state.layers.*.moe.shared_expert.",
    "--rename", "layers.*.moe.shared_experts.=model.layers.*.moe.shared_expert.",
    "--rename", "layers.*.moe.expert_bias=model.layers.*.moe.router.expert_bias",
]
TITAN_MOE_TO_OURS = [*TITAN_STATES, *TITAN_MOE, *TITAN_MAPPING]

# Dense block 0 (feed_forward), MoE block 1 with a shared expert and an expert bias; the GQA
# heads of TITAN_MAPPING's --split-fused (unused here: this model's qkv is not fused).
SHAPE = dict(n_layers=2, n_heads=4, n_kv_heads=2, num_experts=4, shared_experts=1, first_k_dense=1,
             ffn_hidden_dim=48, expert_bias_update_rate=1e-3)

_TO_TITAN = [(r"^layers\.(\d+)\.attention\.(w[qkv])\.", r"layers.\1.attention.qkv_linear.\2."),
             (r"^output\.", "lm_head."),
             (r"^layers\.(\d+)\.moe\.shared_expert\.", r"layers.\1.moe.shared_experts."),
             (r"^layers\.(\d+)\.moe\.router\.expert_bias$", r"layers.\1.moe.expert_bias")]


def _titan_name(fqn: str) -> str:
    for pattern, replacement in _TO_TITAN:
        fqn = re.sub(pattern, replacement, fqn)
    return fqn


def _model(seed: int):
    model = build_moe("moe_debug", **SHAPE)
    model.init_weights(seed)
    with torch.no_grad():
        model.layers["1"].moe.router.expert_bias.copy_(torch.arange(4.0) / 8 - seed)
    return model


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)


def _save_like_torchtitan(path: str) -> dict:
    """A trained step of our model saved under torchtitan's names (model keys at the top level,
    the optimizer flattened per parameter); returns every tensor in our names."""
    model = _model(seed=5)
    optim = _optimizer(model)
    for name, param in model.named_parameters():
        param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    optim.step()
    titan = {_titan_name(k): v for k, v in model.state_dict().items()}
    assert {"layers.1.moe.router.gate.weight", "layers.1.moe.experts.w1", "layers.1.moe.shared_experts.w2.weight",
            "layers.1.moe.expert_bias", "layers.0.feed_forward.w1.weight", "lm_head.weight"} <= titan.keys()
    assert titan["layers.1.moe.experts.w1"].shape == (4, 64, 32)  # [num_experts, hidden_dim, dim]
    titan["layers.1.moe.tokens_per_expert"] = torch.tensor([3.0, 1.0, 0.0, 4.0])
    names = {param: name for name, param in model.named_parameters()}
    group = {k: v for k, v in optim.param_groups[0].items() if k != "params"}
    flat = {}
    for param, state in optim.state.items():
        flat.update({f"state.{_titan_name(names[param])}.{k}": v for k, v in state.items()})
        flat.update({f"param_groups.{_titan_name(names[param])}.{k}": v for k, v in group.items()})
    torch_dcp.save({**titan, "optimizer": flat, "train_state": {"step": 1}}, checkpoint_id=path)
    expected = {f"model.{k}": v for k, v in model.state_dict().items()}
    expected.update({f"optim.state.{names[p]}.{k}": v for p, state in optim.state.items() for k, v in state.items()})
    return expected


def _load_into_our_moe(path: str) -> dict:
    model = _model(seed=6)
    optim = _optimizer(model)
    hdcp.load({"model": hdcp.ModelState(model), "optim": hdcp.OptimizerState(model, optim)}, checkpoint_id=path,
              no_dist=True)
    flat, _ = hdcp.flatten_state_dict({"model": hdcp.get_model_state_dict(model),
                                       "optim": hdcp.get_optimizer_state_dict(model, optim)})
    return flat


def test_torchtitan_moe_checkpoint_imports_and_loads_every_tensor(tmp_path):
    src, dst = str(tmp_path / "titan"), str(tmp_path / "ours")
    expected = _save_like_torchtitan(src)
    assert main(["import-dcp", src, dst, *TITAN_MOE_TO_OURS]) == 0
    assert main(["verify", dst]) == 0
    loaded = _load_into_our_moe(dst)
    groups = loaded.pop("optim.param_groups")
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.1 and tuple(groups[0]["betas"]) == (0.9, 0.95)
    imported = set(hdcp.read_checkpoint_metadata(dst).state_dict_metadata)
    assert imported == expected.keys() | {"optim.param_groups"}, imported ^ (expected.keys() | {"optim.param_groups"})


def test_the_moe_rules_are_the_documented_ones():
    with open(DOC) as f:
        doc = f.read()
    for flag, rule in zip(TITAN_MOE[::2], TITAN_MOE[1::2]):
        assert f"{flag} '{rule}'" in doc, rule
