"""docs/moe.md's snippets run as written: in order, in one namespace, on 2 gloo ranks (as
``torchrun --nproc_per_node=2`` would run them), and do what the page says they do."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from tests.multirank import run_on_ranks

DOC = Path(__file__).parents[1] / "docs" / "moe.md"


def _snippets():
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def _run_snippets(folder: str, snippets):
    scope: dict = {}
    cwd = os.getcwd()
    os.chdir(folder)  # the snippets write moe-run/ and moe-hf/ under the working directory
    try:
        for snippet in snippets:
            exec(compile(snippet, str(DOC), "exec"), scope)  # noqa: S102 - the docs' own code
    finally:
        os.chdir(cwd)
    full = {name: p.full_tensor() for name, p in scope["model"].named_parameters()}
    loaded = {name: p.full_tensor() for name, p in scope["loaded"].named_parameters()}
    return {"loss": scope["loss"].item(), "aux": scope["aux"].item(), "counts": scope["counts"],
            "same_after_export_and_load": all(torch.equal(full[n], loaded[n]) for n in full),
            "pipeline_losses": [x.item() for x in scope["losses"]], "dtype": scope.get("dtype")}


def test_every_moe_md_snippet_runs_as_written(tmp_path):
    snippets = _snippets()
    assert len(snippets) == 4
    results = run_on_ranks(2, _run_snippets, str(tmp_path), snippets, timeout=240)
    for result in results:
        assert 0 < result["loss"] < 10 and result["aux"] > 0
        assert [int(c.sum()) for c in result["counts"].values()] == [4 * 32 * 2] * 2  # tokens x top_k per block
        assert result["same_after_export_and_load"]  # the Qwen3-MoE export loads back exactly
    assert results[0]["dtype"] == torch.float32 and results[1]["dtype"] is None  # rank 0 exported
    assert not results[0]["pipeline_losses"] and len(results[1]["pipeline_losses"]) == 2  # the last stage's
    config = (tmp_path / "moe-hf" / "config.json").read_text()
    assert '"dtype": "float32"' in config and '"torch_dtype": "float32"' in config


def _saved_bytes_per_token(cfg, layer: int, dtype: torch.dtype, batch: int = 4, seq: int = 64) -> float:
    """What one block of ``cfg`` saves for its backward per token, measured with the block's
    weights and input in ``dtype`` (the RoPE tables stay float32, as mixed precision leaves the
    root's buffers): the distinct storages torch's saved-tensor hooks see, less the weights,
    buffers and RoPE tables. The routed experts must take the grouped GEMM path, as in production."""
    from hyper_parallel.models.moe import MoETransformer
    from hyper_parallel.models.moe_layer import ExpertMatmul, expert_matmul

    model = MoETransformer(cfg)
    model.init_weights(seed=0)
    block = model.layers[str(layer)].to(dtype)
    if block.moe is not None:
        experts = block.moe.experts
        sorted_rows = torch.empty(batch * seq * cfg.top_k, cfg.dim, dtype=dtype)
        assert expert_matmul(sorted_rows, experts.w1, experts.w2, experts.w3) is ExpertMatmul.GROUPED_MM
    skip = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *block.buffers(), model.rope_cos,
                                                     model.rope_sin)}
    storages = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in skip:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    x = torch.randn(batch, seq, cfg.dim, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        block(x, model.rope_cos[:seq], model.rope_sin[:seq])
    return sum(storages.values()) / (batch * seq)


def _formula_per_token(cfg, dense: bool, b: int) -> int:
    """docs/moe.md's arithmetic: one block's saved activations per token (``b``: the compute
    dtype's bytes, 2 or 4; the float32 terms at 4 B, the int64 indices at 8 B)."""
    d, heads, kv_heads, head_dim, q = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, int(cfg.qk_norm)
    total = (b * (4 * d + (3 + q) * heads * head_dim + (2 + q) * kv_heads * head_dim)
             + 4 * (2 * d + q * (heads + kv_heads) * head_dim) + 4 * (2 + (1 + q) * heads + q * kv_heads))
    if dense:
        return total + b * 4 * cfg.ffn_hidden_dim
    k, h = cfg.top_k, cfg.moe_ffn_dim
    return (total + b * (k * d + 4 * k * h + 4 * cfg.shared_experts * h)
            + 4 * (k * d + cfg.num_experts + k + (1 + k) * int(cfg.norm_topk_prob)) + 8 * 3 * k)


def test_the_activation_arithmetic_matches_a_measurement_and_the_docs_table():
    from hyper_parallel.models.moe import MOE_CONFIGS, MoEConfig

    base = dict(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=8, num_experts=8, top_k=2,
                moe_ffn_dim=64, max_seq_len=64, aux_loss_weight=0.01)
    shapes = [{}, dict(top_k=4, num_experts=16, n_heads=8),  # Qwen3-like; DeepSeek-like below
              dict(qk_norm=False, shared_experts=2, expert_bias_update_rate=1e-3, first_k_dense=1, ffn_hidden_dim=96,
                   n_layers=2, norm_topk_prob=False, aux_loss_weight=0.0)]
    for changes in shapes:
        cfg = MoEConfig(**{**base, **changes})
        for layer in range(cfg.n_layers):
            for dtype in (torch.bfloat16, torch.float32):  # production's compute dtype, and float32
                measured = _saved_bytes_per_token(cfg, layer, dtype)
                formula = _formula_per_token(cfg, layer < cfg.first_k_dense, dtype.itemsize)
                # the per-block constants (the token counts, the offsets, the aux loss) are under a byte per token
                assert 0 <= measured - formula < 1, (changes, layer, dtype, measured, formula)
    docs = DOC.read_text()
    tokens = 4096
    for name in ("qwen3_30b_a3b", "deepseek_v3_16b"):
        cfg = MoEConfig(**MOE_CONFIGS[name])
        blocks = [_formula_per_token(cfg, layer < cfg.first_k_dense, 2) for layer in range(cfg.n_layers)]
        # with checkpointing: every block's input, every MoE block's replayed routing (int64 top_k), one block
        held = cfg.n_layers * cfg.dim * 2 + (cfg.n_layers - cfg.first_k_dense) * 8 * cfg.top_k + max(blocks)
        row = (f"| `{name}` | {_formula_per_token(cfg, False, 2) / 1e3:.1f} KB | {sum(blocks) * tokens / 1e9:.1f} GB | "
               f"{held * tokens / 1e9:.2f} GB | "
               f"{14 * cfg.vocab_size * tokens / 1e9:.1f} GB |")
        assert row in docs, row
