"""torchtitan 0.3.0's own checkpoints of its Llama 3, Qwen3, Qwen3-MoE and DeepSeek-V3 models
into ours, checked against what torchtitan itself writes and computes.

``data/torchtitan_0.3.0.json`` (made by ``tools/torchtitan_checkpoints.py`` with torchtitan
0.3.0 itself) lists every key, shape and dtype of the DCP checkpoint torchtitan's
``CheckpointManager`` wrote for a tiny model of each family (built by torchtitan's own layer
builders), and torchtitan's logits for a fixed input with every weight set by
``titan_tensor``. Here a DCP checkpoint with exactly those keys, shapes and dtypes and those
weights is written (torchtitan not needed), imported with the commands docs/checkpoint.md gives
and loaded into our model: its logits must be torchtitan's, so names, orientations and the
rotary layout (Qwen3 rotates halves, ours interleaves pairs) are all checked at once.
"""

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint import CheckpointError
from hyper_parallel.core.distributed_checkpoint.cli import main
from hyper_parallel.core.distributed_checkpoint.dcp_interop.key_mapping import RenameRule
from hyper_parallel.core.distributed_checkpoint.dcp_interop.rotary_layout import RotateHalf
from hyper_parallel.models.hf_llama import halves_to_interleaved
from hyper_parallel.models.llama import LlamaConfig, RopeScaling, Transformer
from hyper_parallel.models.moe import MoEConfig, MoETransformer
from tests.checkpoint.test_dcp_torchtitan import TITAN_STATES, _unfuse
from tools.torchtitan_checkpoints import DTYPES, titan_tensor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(ROOT, "docs", "checkpoint.md")
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "torchtitan_0.3.0.json")) as _f:
    DATA = json.load(_f)
N_HEADS, N_KV_HEADS = 4, 2  # the tiny models' (tools/torchtitan_checkpoints.py)


def llama_rules(n_heads: int, n_kv_heads: int) -> list:
    """docs/checkpoint.md's torchtitan Llama 3 rules (after its --exclude rules)."""
    return ["--exclude", "dataloader",
            "--split-fused", f"wqkv=wq,wk,wv:{n_heads}:{n_kv_heads}",
            "--rename", "optimizer.state.layers.*.attention.qkv_linear.=optim.state.layers.*.attention.",
            "--rename", "optimizer.state.lm_head.=optim.state.output.",
            "--rename", "optimizer.=optim.",
            "--rename", "layers.*.attention.qkv_linear.=model.layers.*.attention.",
            "--rename", "lm_head.=model.output.",
            "--rename", "=model."]


def rotate_half_rules(n_heads: int, n_kv_heads: int) -> list:
    """docs/checkpoint.md's rules for torchtitan's Qwen3 rotary layout (rotated halves)."""
    return ["--rotate-half", f"wq:{n_heads}", "--rotate-half", f"wk:{n_kv_heads}",
            "--rotate-half", "q_norm:1", "--rotate-half", "k_norm:1"]


# docs/checkpoint.md's torchtitan MoE rules, before the Llama rules (the first match wins).
MOE_RULES = [arg for ours, titan in (("w1", "w1_EFD"), ("w2", "w2_EDF"), ("w3", "w3_EFD")) for arg in (
    "--rename", f"optimizer.state.layers.*.moe.routed_experts.inner_experts.{titan}=optim.state.layers.*.moe.experts.{ours}",
    "--rename", f"layers.*.moe.routed_experts.inner_experts.{titan}=model.layers.*.moe.experts.{ours}")] + [
    "--rename", "optimizer.state.layers.*.moe.shared_experts.=optim.state.layers.*.moe.shared_expert.",
    "--rename", "layers.*.moe.shared_experts.=model.layers.*.moe.shared_expert.",
    "--rename", "layers.*.moe.expert_bias_E=model.layers.*.moe.router.expert_bias"]

COMMANDS = {
    "llama3": [*TITAN_STATES, *llama_rules(N_HEADS, N_KV_HEADS)],
    "qwen3": [*TITAN_STATES, *rotate_half_rules(N_HEADS, N_KV_HEADS), *llama_rules(N_HEADS, N_KV_HEADS)],
    "qwen3_moe": [*TITAN_STATES, *rotate_half_rules(N_HEADS, N_KV_HEADS), *MOE_RULES,
                  *llama_rules(N_HEADS, N_KV_HEADS)],
}
_QWEN3 = dict(vocab_size=128, dim=64, n_layers=2, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, head_dim=32, qk_norm=True,
              norm_eps=1e-6, rope_theta=1e6, max_seq_len=64)
OURS = {
    "llama3": lambda: Transformer(LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=N_HEADS,
                                              n_kv_heads=N_KV_HEADS, ffn_hidden_dim=96, rope_theta=500000.0,
                                              max_seq_len=64, rope_scaling=RopeScaling())),
    "qwen3": lambda: MoETransformer(MoEConfig(**_QWEN3, tie_embeddings=True, first_k_dense=2, ffn_hidden_dim=96)),
    "qwen3_moe": lambda: MoETransformer(MoEConfig(**_QWEN3, num_experts=8, top_k=2, moe_ffn_dim=32,
                                                  expert_bias_update_rate=1e-3)),
}


def write_titan_checkpoint(family: str, path: str) -> dict:
    """The DCP checkpoint torchtitan wrote for ``family`` (its keys, shapes and dtypes), with the
    tensors of ``titan_tensor``; returns it."""
    record = DATA["families"][family]
    state = {}
    for key, entry in record["keys"].items():
        if "shape" in entry:
            state[key] = titan_tensor(record["tied"].get(key, key), entry["shape"], DTYPES[entry["dtype"]])
        else:
            state[key] = entry["value"] if "value" in entry else bytes(entry["bytes"])
    torch_dcp.save(state, checkpoint_id=path, no_dist=True)
    return state


def _import_and_load(family: str, tmp_path, command: list):
    src, dst = str(tmp_path / family), str(tmp_path / f"{family}-ours")
    titan = write_titan_checkpoint(family, src)
    assert main(["import-dcp", src, dst, *command]) == 0
    model = OURS[family]()
    optim = torch.optim.AdamW(model.parameters(), lr=1.0)
    hdcp.load({"model": hdcp.ModelState(model), "optim": hdcp.OptimizerState(model, optim)}, checkpoint_id=dst,
              no_dist=True)
    return titan, model, optim


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([DATA["tokens"]]))[0].double()


@pytest.mark.parametrize("family", sorted(COMMANDS))
def test_torchtitan_checkpoint_imports_into_our_model_with_torchtitans_logits(family, tmp_path):
    titan, model, optim = _import_and_load(family, tmp_path, COMMANDS[family])
    expected = torch.tensor(DATA["families"][family]["logits"], dtype=torch.float64)
    assert expected.abs().max() > 0.5
    torch.testing.assert_close(_logits(model), expected, rtol=0, atol=1e-4)
    assert optim.param_groups[0]["lr"] == 0.0008 and optim.param_groups[0]["betas"] == (0.9, 0.95)
    params = dict(model.named_parameters())
    if family != "llama3":  # the moments of the rotated rows moved as the weights did (a resume's Adam step)
        fused = titan["optimizer.state.layers.1.attention.qkv_linear.wqkv.weight.exp_avg"]
        wq = _unfuse(fused, N_HEADS, N_KV_HEADS)[0]
        state = optim.state[params["layers.1.attention.wq.weight"]]
        assert torch.equal(state["exp_avg"], halves_to_interleaved(wq, N_HEADS))
        norm = titan["optimizer.state.layers.1.attention.k_norm.weight.exp_avg_sq"]
        state = optim.state[params["layers.1.attention.k_norm.weight"]]
        assert torch.equal(state["exp_avg_sq"], halves_to_interleaved(norm.unsqueeze(1), 1).squeeze(1))
    if family == "qwen3_moe":
        state = optim.state[params["layers.0.moe.experts.w2"]]
        assert torch.equal(state["exp_avg"],
                           titan["optimizer.state.layers.0.moe.routed_experts.inner_experts.w2_EDF.exp_avg"])
        assert torch.equal(model.layers["1"].moe.router.expert_bias, titan["layers.1.moe.expert_bias_E"])


def test_qwen3_without_the_rotary_permutation_gives_other_logits(tmp_path):
    """What the permutation is for: the same import without it loads every weight and is wrong."""
    _, model, _ = _import_and_load("qwen3", tmp_path, [*TITAN_STATES, *llama_rules(N_HEADS, N_KV_HEADS)])
    expected = torch.tensor(DATA["families"]["qwen3"]["logits"], dtype=torch.float64)
    assert (_logits(model) - expected).abs().max() > 1e-2


def test_deepseek_v3_moe_names_map_to_ours(tmp_path):
    """DeepSeek-V3's MoE blocks (routed and shared experts, expert bias) under torchtitan's names
    take our names (its latent attention has no counterpart in our model: left out here)."""
    src, dst = str(tmp_path / "dsv3"), str(tmp_path / "dsv3-ours")
    titan = write_titan_checkpoint("deepseek_v3", src)
    assert main(["import-dcp", src, dst, *TITAN_STATES, "--exclude", "dataloader", "--exclude", "optimizer.",
                 *MOE_RULES, "--rename", "=model."]) == 0
    keys = set(hdcp.read_checkpoint_metadata(dst).state_dict_metadata)
    assert {"model.layers.1.moe.experts.w1", "model.layers.1.moe.experts.w2", "model.layers.1.moe.experts.w3",
            "model.layers.1.moe.shared_expert.w1.weight", "model.layers.1.moe.router.expert_bias",
            "model.layers.1.moe.router.gate.weight"} <= keys
    assert not [k for k in keys if "_E" in k or "routed_experts" in k or "shared_experts" in k]
    assert hdcp.read_checkpoint_metadata(dst).state_dict_metadata["model.layers.1.moe.experts.w2"].size == \
        titan["layers.1.moe.routed_experts.inner_experts.w2_EDF"].shape


def test_the_torchtitan_rules_are_the_documented_ones():
    with open(DOC) as f:
        doc = f.read()
    rules = [*rotate_half_rules("N_HEADS", "N_KV_HEADS"), *MOE_RULES]
    for flag, rule in zip(rules[::2], rules[1::2]):
        assert f"{flag} '{rule}'" in doc or f"{flag} {rule}" in doc, rule
    assert "--rename 'layers.*.moe.expert_bias=" not in doc and "`layers.N.moe.experts.w1`" not in doc


def test_a_pattern_matches_whole_components_and_rotate_half_checks_the_heads():
    rule = RenameRule.parse("layers.*.moe.expert_bias=model.layers.*.moe.router.expert_bias")
    assert rule.apply("layers.1.moe.expert_bias_E") is None
    assert rule.apply("layers.1.moe.expert_bias") == "model.layers.1.moe.router.expert_bias"
    rows = RotateHalf.parse("wq:2").permuted(((0, 8),), "k")
    assert [start + i for start, length in rows for i in range(length)] == [0, 2, 1, 3, 4, 6, 5, 7]
    with pytest.raises(CheckpointError, match=r"'layers.0.attention.wq.weight' \(6 rows on dim 0\).*wq:2"):
        RotateHalf.parse("wq:2").permuted(((0, 6),), "layers.0.attention.wq.weight")
    with pytest.raises(ValueError, match="NAME:N_HEADS"):
        RotateHalf.parse("wq")


def test_torchtitan_itself_end_to_end_where_installed(tmp_path):
    """Where torchtitan 0.3.0 is importable: the data file is what it writes today."""
    pytest.importorskip("torchtitan.components.checkpointer.dcp", reason="torchtitan is not installed")
    from tools.torchtitan_checkpoints import main as regenerate

    out = tmp_path / "now.json"
    assert regenerate([str(out)]) == 0
    now = json.loads(out.read_text())
    for family, record in DATA["families"].items():
        assert now["families"][family]["keys"] == record["keys"], family


def test_excluding_every_key_is_refused_and_writes_nothing(tmp_path, capsys):
    src, dst = str(tmp_path / "llama3"), tmp_path / "ours"
    write_titan_checkpoint("llama3", src)
    assert main(["import-dcp", src, str(dst), "--exclude", "*"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: nothing to import: --exclude leaves none of the 280 entries") and \
        len(err.strip().splitlines()) == 1, err
    assert not dst.exists() and [p.name for p in tmp_path.iterdir()] == ["llama3"]
