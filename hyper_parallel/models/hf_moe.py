"""The ``transformers`` Qwen3-MoE layout (``Qwen3MoeForCausalLM``): tensor names, the
per-expert tensors, the rotary permutation and ``config.json``.

On disk (the Hub's checkpoints and ``save_pretrained`` in transformers 5, which fuses the
experts only in memory) each expert has its own tensors,
``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``; ours are stacked on dim 0 in
``moe.experts.{w1,w3,w2}``. Loading describes the directory with the per-expert tensors as the
chunks of the stacked ones, so that each rank reads only the experts (and rows) of its own
shards. Attention rotates halves in ``transformers`` and interleaved pairs here: as for Llama
(:mod:`hyper_parallel.models.hf_llama`), the rows of ``wq``/``wk`` are permuted per head, and so
are the per-head ``q_norm``/``k_norm`` weights.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Optional, Union

import torch
from torch import nn

from hyper_parallel.core.distributed_checkpoint.format.metadata import (ChunkStorageMetadata, Metadata,
                                                                         MetadataIndex, TensorStorageMetadata)
from hyper_parallel.core.distributed_checkpoint.format.validation import check_metadata
from hyper_parallel.core.distributed_checkpoint.hf import Converted, hf_metadata
from hyper_parallel.models.hf_llama import (CONFIG_FILE, hf_dtype_keys, hf_rope_scaling, interleaved_to_halves,
                                            read_config, rows_to_interleaved_)
from hyper_parallel.models.moe import MoEConfig, MoETransformer

__all__ = ["check_config", "hf_config", "hf_names", "load_pretrained", "moe_config", "stacked_metadata", "to_hf",
           "unsupported"]

MODEL_TYPE = "qwen3_moe"
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
}
_EXPERT_NAMES = {"moe.experts.w1": "gate_proj", "moe.experts.w2": "down_proj", "moe.experts.w3": "up_proj"}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
# Rows permuted for the rotary layout: name -> the config field with its head count (norms: 1 head).
_ROTARY = {"attention.wq.weight": "n_heads", "attention.wk.weight": "n_kv_heads",
           "attention.q_norm.weight": None, "attention.k_norm.weight": None}


def unsupported(cfg: MoEConfig) -> List[str]:
    """What of ``cfg`` transformers' Qwen3-MoE cannot express, as one line (empty: nothing)."""
    found = [text for bad, text in ((cfg.shared_experts > 0, f"shared_experts={cfg.shared_experts}"),
                                    (cfg.router_bias, "router_bias=True"),
                                    (cfg.expert_bias_update_rate > 0,
                                     f"expert_bias_update_rate={cfg.expert_bias_update_rate}"),
                                    (not cfg.qk_norm, "qk_norm=False")) if bad]
    return [f"transformers' Qwen3-MoE has no equivalent of {', '.join(found)}"] if found else []


def hf_names(name: str, cfg: MoEConfig) -> Union[str, List[str]]:
    """The ``transformers`` name of one of our parameter names, or for grouped experts the names
    of the per-expert tensors they stack (expert order).

    Raises:
        KeyError: not a parameter of the MoE model.
    """
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _LAYER.fullmatch(name)
    prefix = f"model.layers.{match.group(1)}" if match else ""
    if match and match.group(2) in _LAYER_NAMES:
        return f"{prefix}.{_LAYER_NAMES[match.group(2)]}"
    if match and match.group(2) in _EXPERT_NAMES:
        return [f"{prefix}.mlp.experts.{e}.{_EXPERT_NAMES[match.group(2)]}.weight" for e in range(cfg.num_experts)]
    raise KeyError(f"{name!r} is not a parameter of hyper_parallel's MoE model in the Qwen3-MoE layout")


def _heads(name: str, cfg: MoEConfig) -> Optional[int]:
    match = _LAYER.fullmatch(name)
    if not match or match.group(2) not in _ROTARY:
        return None
    field = _ROTARY[match.group(2)]
    return 1 if field is None else getattr(cfg, field)


def to_hf(name: str, tensor: torch.Tensor, cfg: MoEConfig) -> Converted:
    """For export (e.g. ``export_hf``'s ``convert``): ``(transformers name, tensor)``, the
    per-expert tensors of grouped experts (a mapping), or None for the output head of tied
    embeddings."""
    if name == "output.weight" and cfg.tie_embeddings:
        return None
    names = hf_names(name, cfg)
    if isinstance(names, list):
        return {hf: tensor[e].contiguous() for e, hf in enumerate(names)}
    heads = _heads(name, cfg)
    if heads:
        tensor = interleaved_to_halves(tensor.reshape(tensor.shape[0], -1), heads).view_as(tensor)
    return names, tensor.contiguous()


def hf_config(cfg: MoEConfig, dtype: torch.dtype) -> Dict[str, Any]:
    """``config.json`` for ``transformers.Qwen3MoeForCausalLM``.

    Raises:
        ValueError: ``cfg`` uses what Qwen3-MoE cannot express (shared experts, router or expert
            biases, attention without q/k norm).
    """
    problems = unsupported(cfg)
    if problems:
        raise ValueError(problems[0])
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_hidden_dim or cfg.top_k * cfg.moe_ffn_dim,
        "moe_intermediate_size": cfg.moe_ffn_dim, "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.top_k, "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(cfg.first_k_dense)), "router_aux_loss_coef": cfg.aux_loss_weight,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "use_sliding_window": False, **hf_dtype_keys(dtype),
    }


def moe_config(config: Dict[str, Any], **overrides: Any) -> MoEConfig:
    """The :class:`MoEConfig` of a Qwen3-MoE ``config.json`` (a dict), with field overrides
    (e.g. ``aux_loss_weight``, ``max_seq_len``), read as ``transformers`` does.

    Raises:
        ValueError: not a Qwen3-MoE config, a key is missing, or it uses what this model lacks
            (sparse steps other than 1, dense layers other than the first ones, rope scaling,
            sliding windows, attention biases, another activation).
    """
    if config.get("model_type") != MODEL_TYPE:
        raise ValueError(f"config model_type {config.get('model_type')!r} is not {MODEL_TYPE!r}")
    needed = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "moe_intermediate_size",
              "num_experts_per_tok")
    missing = [key for key in needed if key not in config]
    experts = config.get("num_experts", config.get("num_local_experts"))
    if experts is None:
        missing.append("num_experts")
    if missing:
        raise ValueError(f"the Qwen3-MoE config lacks {', '.join(missing)}")
    layers = config["num_hidden_layers"]
    step = config.get("decoder_sparse_step", 1)
    dense = sorted(set(config.get("mlp_only_layers") or []) | {i for i in range(layers) if (i + 1) % step})
    problems = []
    if dense != list(range(len(dense))):
        problems.append(f"dense layers {dense} are not the first ones (mlp_only_layers / decoder_sparse_step)")
    if hf_rope_scaling(config) is not None:
        problems.append("rope scaling is not supported for the MoE model")
    for key, ok in (("use_sliding_window", False), ("attention_bias", False), ("hidden_act", "silu")):
        if config.get(key, ok) != ok:
            problems.append(f"{key}={config[key]!r} is not supported (only {ok!r})")
    if problems:
        raise ValueError("; ".join(problems))
    rope_theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    fields = dict(
        vocab_size=config["vocab_size"], dim=config["hidden_size"], n_layers=layers,
        n_heads=config["num_attention_heads"], n_kv_heads=config.get("num_key_value_heads"),
        head_dim=config.get("head_dim"), qk_norm=True, norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope_theta), max_seq_len=config.get("max_position_embeddings", 256),
        tie_embeddings=config.get("tie_word_embeddings", False), num_experts=experts,
        top_k=config["num_experts_per_tok"], moe_ffn_dim=config["moe_intermediate_size"],
        norm_topk_prob=config.get("norm_topk_prob", False), first_k_dense=len(dense),
        ffn_hidden_dim=config.get("intermediate_size", 0) if dense else 0)
    return MoEConfig(**{**fields, **overrides})


_CHECKED = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "qk_norm", "rope_theta",
            "tie_embeddings", "num_experts", "top_k", "moe_ffn_dim", "norm_topk_prob", "first_k_dense",
            "ffn_hidden_dim", "norm_eps")


def check_config(path: str, cfg: MoEConfig) -> None:
    """Check that the ``config.json`` of the HF directory ``path`` describes the model of ``cfg``
    (without it, other head counts with the same shapes would load permuted for the wrong heads).

    Raises:
        ValueError: no or an unreadable ``config.json``, not a Qwen3-MoE one, ``cfg`` has what
            Qwen3-MoE lacks, or the shapes differ (one line naming each differing field).
    """
    problems = unsupported(cfg)
    if problems:
        raise ValueError(problems[0])
    config = read_config(path)
    file = os.path.join(path, CONFIG_FILE)
    if config is None:
        raise ValueError(f"{path} has no {CONFIG_FILE} (a transformers Qwen3-MoE directory has one)")
    try:
        stored = moe_config(config)
    except ValueError as err:
        raise ValueError(f"{file}: {err}") from None
    differences = [f"{field} {getattr(stored, field)!r} vs model.{field}={getattr(cfg, field)!r}"
                   for field in _CHECKED if getattr(stored, field) != getattr(cfg, field)]
    if differences:
        raise ValueError(f"{file} does not describe this model: {'; '.join(differences)}")


def stacked_metadata(path: str, names: Dict[str, Union[str, List[Union[str, List[str]]]]]) -> Metadata:
    """The checkpoint metadata of the HF directory ``path`` under our names: each of ``names``
    maps one of ours to one stored tensor, or to a list of equally shaped ones that become the
    chunks of one tensor stacked on a new dim 0; an item of that list may itself be a list of
    stored tensors concatenated on their dim 0 (``transformers``' fused ``gate_up_proj``: each
    expert's gate rows then its up rows).

    Raises:
        KeyError: stored tensors are missing (all named).
        ValueError: tensors to stack or concatenate differ in dtype or shape.
        CheckpointError: as :func:`~hyper_parallel.core.distributed_checkpoint.hf.hf_metadata`.
    """
    source = hf_metadata(path)
    stored = source.state_dict_metadata
    groups_of = {ours: [[keys]] if isinstance(keys, str) else [[k] if isinstance(k, str) else list(k) for k in keys]
                 for ours, keys in names.items()}
    missing = [key for groups in groups_of.values() for group in groups for key in group if key not in stored]
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise KeyError(f"{path} does not hold {missing[:4]}{more}")
    out = Metadata(state_dict_metadata={})
    out.files.update(source.files)
    for ours, groups in groups_of.items():
        stack = not isinstance(names[ours], str)
        parts = [key for group in groups for key in group]
        first, joined = stored[parts[0]], len(groups[0])
        for key in parts:
            if (stored[key].dtype, stored[key].size) != (first.dtype, first.size):
                raise ValueError(f"{path}: {key} is {stored[key].dtype} {tuple(stored[key].size)}, "
                                 f"{parts[0]} {first.dtype} {tuple(first.size)}: they cannot be stacked into {ours}")
        if any(len(group) != joined for group in groups) or (joined > 1 and not first.size):
            raise ValueError(f"{path}: the tensors of {ours} cannot be concatenated (unequal groups or scalars)")
        shape = tuple(first.size)
        chunks = []
        for index, group in enumerate(groups):
            for offset, key in enumerate(group):
                origin = ((index,) if stack else ()) + tuple(offset * n if d == 0 else 0 for d, n in enumerate(shape))
                chunks.append(ChunkStorageMetadata(origin, ((1,) if stack else ()) + shape))
                out.storage_data[MetadataIndex(ours, origin)] = \
                    source.storage_data[MetadataIndex(key, (0,) * len(shape))]
        joined_shape = (shape[0] * joined, *shape[1:]) if shape else shape
        size = ((len(groups),) if stack else ()) + joined_shape
        out.state_dict_metadata[ours] = TensorStorageMetadata(first.dtype, size, chunks)
    check_metadata(out, path)
    return out


def load_pretrained(model: nn.Module, path: str, cfg: MoEConfig) -> None:
    """Fill ``model`` (an :class:`~hyper_parallel.models.moe.MoETransformer` of ``cfg``, plain
    or sharded, or a pipeline stage of one) from the ``transformers`` Qwen3-MoE directory
    ``path`` (collective): each rank reads only its slices (its experts' tensors); the q/k
    projections and norms are gathered once to be permuted. :func:`check_config` first.

    Raises:
        ValueError: as :func:`check_config`, or a stored shape differs from the model's.
        KeyError / CheckpointError: stored tensors are missing, or the files are unreadable.
    """
    from hyper_parallel.checkpoint import get_model_state_dict, load_hf

    check_config(path, cfg)
    ours = get_model_state_dict(model)
    targets = {k: v for k, v in ours.items() if not (k == "output.weight" and cfg.tie_embeddings)}
    # The whole model's names, whatever part ``model`` is (a pipeline stage): the ranks plan the
    # load together from one description of the directory.
    with torch.device("meta"):
        names = [k for k in MoETransformer(cfg).state_dict() if not (k == "output.weight" and cfg.tie_embeddings)]
    load_hf(targets, path, metadata=stacked_metadata(path, {k: hf_names(k, cfg) for k in names}))
    for name, tensor in targets.items():
        heads = _heads(name, cfg)
        if heads:
            rows_to_interleaved_(tensor, heads)
