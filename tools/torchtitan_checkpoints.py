"""Regenerates ``tests/checkpoint/data/torchtitan_0.3.0.json``: what torchtitan 0.3.0 itself
writes for its Llama 3, Qwen3, Qwen3-MoE and DeepSeek-V3 models, so that the import tests
check the names torchtitan writes, not names written by hand.

Run it once in an environment that has torchtitan 0.3.0 (and its own torch):

    python -m venv /tmp/ttvenv && /tmp/ttvenv/bin/pip install torchtitan==0.3.0
    /tmp/ttvenv/bin/python tools/torchtitan_checkpoints.py tests/checkpoint/data/torchtitan_0.3.0.json

Per family it builds a tiny model with torchtitan's own layer builders (the ones its
``debugmodel`` flavours call, at smaller sizes), takes one AdamW step and saves it with
torchtitan's ``CheckpointManager``, then records:

- ``keys``: every entry of the DCP ``.metadata`` torchtitan wrote: tensors as their shape and
  dtype, values (the flattened param groups, the LR schedule, the train state) as their value,
  the data loader's pickled bytes as their length;
- ``logits`` (the families our models can hold): the logits of torchtitan's model, computed in
  float64, for ``TOKENS`` with every weight set by :func:`titan_tensor` (rounded to the dtype
  listed in ``keys``; a tied ``lm_head.weight`` takes the value of ``tok_embeddings.weight``,
  as ``tied`` says), so a test can rebuild the same weights under torchtitan's names, import
  them and compare our model's logits with torchtitan's.

:func:`titan_tensor` is importable without torchtitan (the tests use it).
"""

from __future__ import annotations

import json
import sys
import zlib
from typing import Any, Dict, List, Sequence

import torch
import torch.nn.functional as F

TOKENS = [3, 17, 42, 7, 99, 1, 64, 120]
"""The token ids the recorded logits are computed for (one sequence)."""

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "int64": torch.int64}


def titan_tensor(key: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The test value of the tensor ``key``: seeded by its name, so the same under any process
    and any torch on CPU (float64 normal draws, then rounded to ``dtype``)."""
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    value = torch.randn(tuple(shape), dtype=torch.float64, generator=generator)
    if key.endswith("step") or not len(shape) and "step" in key:
        value = torch.full(tuple(shape), 3.0, dtype=torch.float64)
    elif "exp_avg_sq" in key:
        value = value.abs() * 1e-3
    elif key.endswith("norm.weight"):
        value = 1.0 + 0.1 * value
    elif "expert_bias" in key:
        value = 0.02 * value
    else:
        value = 0.1 * value
    return value.to(dtype)


# ----------------------------------------------------------------------------- torchtitan's models


def _llama3():
    from torchtitan.models import llama3 as L
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm

    dim, vocab = 64, 128
    return L.Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=L._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=L._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=L._output_linear_init(dim)),
        layers=L._build_llama3_layers(
            fuse_qkv=True, n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, hidden_dim=96, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=dim // 4, max_seq_len=64, theta=500000, scaling="llama")))


def _qwen3(moe: bool):
    from torchtitan.models import qwen3 as Q
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    dim, vocab, head_dim = 64, 128, 32  # head_dim * n_heads != dim, as in Qwen3's flavours
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1000000.0)
    shape = dict(fuse_qkv=True, n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=head_dim, attn_backend="flex",
                 rope=rope)
    layers = (Q._build_qwen3_moe_layers(**shape, moe_hidden_dim=32, num_experts=8, top_k=2,
                                        moe_comm_backend="standard") if moe
              else Q._build_qwen3_layers(**shape, hidden_dim=96))
    return Q.Qwen3Model.Config(
        vocab_size=vocab, dim=dim, norm=Q._qwen3_norm(dim), enable_weight_tying=not moe,  # as its debugmodels
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=Q._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=Q._LINEAR_INIT),
        layers=layers)


def _deepseek_v3():
    from torchtitan.models import deepseek_v3 as D
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear
    from torchtitan.models.common.nn_modules import RMSNorm

    dim, vocab = 64, 128
    layers = D._build_dsv3_layers(
        n_layers=2, n_dense_layers=1, dim=dim, n_heads=4, q_lora_rank=0, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, mscale=0.70, dense_hidden_dim=96, moe_hidden_dim=32, num_experts=8,
        num_shared_experts=2, router_top_k=3, router_score_func="softmax", attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=64, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=32))
    return D.DeepSeekV3Model.Config(
        vocab_size=vocab, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=D._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=D._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=D._output_linear_init(dim)),
        layers=layers, mtp_layers=[])


# family -> (config builder, record logits: our models have a counterpart of its attention)
FAMILIES = {
    "llama3": (_llama3, True),
    "qwen3": (lambda: _qwen3(moe=False), True),
    "qwen3_moe": (lambda: _qwen3(moe=True), True),
    "deepseek_v3": (_deepseek_v3, False),  # multi-head latent attention: no counterpart in ours
}


class _TrainState:
    """What torchtitan's Trainer saves as ``train_state``."""

    def state_dict(self) -> Dict[str, Any]:
        return {"step": torch.tensor(1), "ntokens_seen": torch.tensor(64)}

    def load_state_dict(self, state: Dict[str, Any]) -> None:  # pragma: no cover - not loaded here
        pass


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _saved_entries(folder: str) -> Dict[str, Dict[str, Any]]:
    """{key: {"shape", "dtype"} | {"value"} | {"bytes"}} of the DCP checkpoint ``folder``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    metadata = FileSystemReader(folder).read_metadata()
    entries: Dict[str, Dict[str, Any]] = {}
    values = [k for k, md in metadata.state_dict_metadata.items() if not isinstance(md, TensorStorageMetadata)]
    loaded = _load_state_dict_from_keys(set(values), checkpoint_id=folder)
    flat: Dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and prefix not in values:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            flat[prefix] = value
    walk("", loaded)
    for key, md in sorted(metadata.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            entries[key] = {"shape": list(md.size), "dtype": str(md.properties.dtype).removeprefix("torch.")}
        elif isinstance(flat.get(key), (bytes, bytearray)) or hasattr(flat.get(key), "getbuffer"):
            raw = flat[key]
            entries[key] = {"bytes": len(raw.getbuffer() if hasattr(raw, "getbuffer") else raw)}
        else:
            entries[key] = {"value": _plain(flat[key])}
    return entries


def _save(config: Any, folder: str) -> Any:
    from torchtitan.components.checkpointer.dcp import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    model = config.build()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(titan_tensor(name, param.shape, param.dtype))
    optimizers = default_adamw(lr=8e-4).build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    manager = CheckpointManager.Config(enable=True, folder="checkpoint", interval=1, keep_latest_k=0).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": _TrainState()}, sd_adapter=None, base_folder=folder)
    for name, param in model.named_parameters():
        param.grad = titan_tensor("grad." + name, param.shape, param.dtype)
    optimizers.step()
    schedulers.step()
    assert manager.save(curr_step=1)
    manager.close()
    return model


TIED = {"lm_head.weight": "tok_embeddings.weight"}
"""The value a tied output head takes (that of the embedding it is tied to)."""


def _experts_in_input_dtype(self: Any, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``GroupedExperts.forward`` (SwiGLU per expert over its run of tokens), in the
    input's dtype: torchtitan's own runs its grouped products in bfloat16 always."""
    out = torch.zeros(x_RD.shape[0], self.w2_EDF.shape[1], dtype=x_RD.dtype)
    start = 0
    for expert, count in enumerate(num_tokens_per_expert_E.tolist()):
        x = x_RD[start:start + count]
        out[start:start + count] = (F.silu(x @ self.w1_EFD[expert].T) * (x @ self.w3_EFD[expert].T)) \
            @ self.w2_EDF[expert].T
        start += count
    return out


def _logits(model: Any, entries: Dict[str, Dict[str, Any]], tied: bool) -> List[List[float]]:
    """torchtitan's float64 logits for ``TOKENS`` with the weights :func:`titan_tensor` gives
    the checkpoint's model keys (rounded to their stored dtype); the grouped experts' products
    in float64 too (:func:`_experts_in_input_dtype`)."""
    from torchtitan.models.common.moe import GroupedExperts
    from torchtitan.models.common.rope import RoPE

    GroupedExperts.forward = _experts_in_input_dtype
    model = model.to(torch.float64)
    state = {}
    for key, value in model.state_dict().items():
        if key in entries and "shape" in entries[key]:
            name = TIED.get(key, key) if tied else key
            state[key] = titan_tensor(name, value.shape, DTYPES[entries[key]["dtype"]]).to(value.dtype)
        else:
            state[key] = value
    model.load_state_dict(state)
    for module in model.modules():  # the rotary caches, rebuilt (`to(float64)` drops a complex one's imaginary part)
        if isinstance(module, RoPE):
            cache = module._precompute_cache()
            module.cache = cache if cache.is_complex() else cache.to(torch.float64)
    tokens = torch.tensor([TOKENS])
    positions = torch.arange(len(TOKENS)).unsqueeze(0)
    with torch.no_grad():
        out = model(tokens, positions, model.get_attention_masks(positions))
    return [[round(float(x), 12) for x in row] for row in out[0]]


def main(argv: Sequence[str]) -> int:
    import tempfile

    import torchtitan
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common import attention

    # torchtitan compiles flex attention, which this CPU build cannot: its eager form computes the same.
    attention.FlexAttention._compiled_flex_attn = flex_attention
    attention._compiled_create_block_mask = create_block_mask

    out: Dict[str, Any] = {"torchtitan": getattr(torchtitan, "__version__", "0.3.0"), "torch": torch.__version__,
                           "tokens": TOKENS, "families": {}}
    for family, (build, with_logits) in FAMILIES.items():
        torch.manual_seed(0)
        config = build()
        with tempfile.TemporaryDirectory() as folder:
            model = _save(config, folder)
            entries = _saved_entries(f"{folder}/checkpoint/step-1")
        tied = bool(getattr(config, "enable_weight_tying", False))
        record: Dict[str, Any] = {"keys": entries, "tied": TIED if tied else {}}
        if with_logits:
            record["logits"] = _logits(model, entries, tied)
        out["families"][family] = record
        print(f"{family}: {len(entries)} entries", file=sys.stderr)
    with open(argv[0], "w") as f:
        json.dump(out, f, indent=0, sort_keys=True, separators=(",", ":"))
        f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
