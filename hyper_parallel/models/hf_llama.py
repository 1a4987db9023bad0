"""The ``transformers`` Llama layout: tensor names, the rotary permutation and ``config.json``.

Our attention rotates interleaved pairs ``(x[2i], x[2i+1])`` (Meta's layout); ``transformers``
rotates halves ``(x[i], x[i + head_dim/2])``. Exporting permutes the rows of ``wq``/``wk`` within
each head accordingly (the permutation of Meta's ``convert_llama_weights_to_hf.py``), so
``LlamaForCausalLM`` computes the same function; reading such a directory inverts it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from enum import Enum
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hyper_parallel.core.layout import local_part
from hyper_parallel.models.llama import LlamaConfig, RopeScaling

CONFIG_FILE = "config.json"
HF_DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16",
                  torch.float16: "float16"}
"""config.json's ``dtype`` of each dtype a checkpoint may be exported in."""
# Our name -> transformers name; {i} is the layer index.
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_ROTARY = {"attention.wq.weight": "n_heads", "attention.wk.weight": "n_kv_heads"}


def hf_name(name: str) -> str:
    """The ``transformers`` name of one of our parameter names.

    Raises:
        KeyError: not a Llama parameter name.
    """
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _LAYER.fullmatch(name)
    if not match or match.group(2) not in _LAYER_NAMES:
        raise KeyError(f"{name!r} is not a parameter of hyper_parallel's Llama")
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


def _heads(name: str, cfg: LlamaConfig) -> Optional[int]:
    match = _LAYER.fullmatch(name)
    return getattr(cfg, _ROTARY[match.group(2)]) if match and match.group(2) in _ROTARY else None


def interleaved_to_halves(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection from interleaved rotary pairs to rotated halves, per head."""
    rows, cols = weight.shape
    return weight.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_interleaved(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse of :func:`interleaved_to_halves`."""
    rows, cols = weight.shape
    return weight.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def to_hf(name: str, tensor: torch.Tensor, cfg: LlamaConfig) -> Optional[Tuple[str, torch.Tensor]]:
    """``(transformers name, tensor)`` for export; None for the output head of tied embeddings."""
    if name == "output.weight" and cfg.tie_embeddings:
        return None
    heads = _heads(name, cfg)
    return hf_name(name), (interleaved_to_halves(tensor, heads) if heads else tensor).contiguous()


def hf_dtype_keys(dtype: torch.dtype) -> Dict[str, str]:
    """config.json's entries naming the weights' ``dtype``: ``dtype`` (transformers 5's key,
    which ``from_pretrained`` loads the weights in) and ``torch_dtype`` (the same value, for
    transformers 4; transformers 5 prefers ``dtype`` when both are there).

    Raises:
        ValueError: a dtype transformers' configs do not name (e.g. an integer type).
    """
    if dtype not in HF_DTYPE_NAMES:
        raise ValueError(f"cannot export weights of dtype {dtype}: config.json's dtype takes "
                         f"{', '.join(HF_DTYPE_NAMES.values())}")
    return {"dtype": HF_DTYPE_NAMES[dtype], "torch_dtype": HF_DTYPE_NAMES[dtype]}


def exported_dtype(checkpoint: str) -> torch.dtype:
    """The dtype of the weights :func:`~hyper_parallel.checkpoint.export_hf` writes from the
    checkpoint ``checkpoint`` (it converts no dtype: the checkpoint's own, e.g. ``bfloat16``
    after ``checkpoint.export_dtype=bfloat16``): what config.json must name (:func:`hf_dtype_keys`).

    Raises:
        ValueError: the checkpoint's model has floating-point tensors of several dtypes, or none.
        CheckpointError: ``checkpoint`` is not a committed checkpoint.
    """
    from hyper_parallel.checkpoint import read_checkpoint_metadata
    from hyper_parallel.core.distributed_checkpoint.format.metadata import TensorStorageMetadata

    stored = read_checkpoint_metadata(checkpoint).state_dict_metadata
    dtypes = {md.dtype for name, md in stored.items() if name.startswith("model.")
              and isinstance(md, TensorStorageMetadata) and md.dtype.is_floating_point}
    if len(dtypes) != 1:
        found = ", ".join(sorted(str(d) for d in dtypes)) or "none"
        raise ValueError(f"{checkpoint}: the model's floating-point tensors must have one dtype for config.json "
                         f"to name, found {found}")
    return dtypes.pop()


def hf_config(cfg: LlamaConfig, dtype: torch.dtype) -> Dict[str, Any]:
    """``config.json`` for ``transformers.LlamaForCausalLM``; RoPE scaling as both
    ``rope_scaling`` (Llama 3.1's own configs, transformers 4) and ``rope_parameters`` (transformers 5)."""
    scaling = None if cfg.rope_scaling is None else {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_hidden_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.dim // cfg.n_heads,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": scaling,
        "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, **hf_dtype_keys(dtype),
    }


class Layout(Enum):
    """The tensor names of an HF-style directory: ``transformers`` Llama, or ours."""

    TRANSFORMERS = "transformers"
    NATIVE = "native"


NATIVE_ARCHITECTURE = "hyper_parallel.models.llama.Transformer"
# (config.json key, LlamaConfig field) compared with the model before loading, per layout.
_CHECKED = {
    Layout.TRANSFORMERS: (("hidden_size", "dim"), ("num_hidden_layers", "n_layers"),
                          ("num_attention_heads", "n_heads"), ("num_key_value_heads", "n_kv_heads"),
                          ("vocab_size", "vocab_size"), ("intermediate_size", "ffn_hidden_dim"),
                          ("rope_theta", "rope_theta"), ("rope_scaling", "rope_scaling"),
                          ("tie_word_embeddings", "tie_embeddings")),
    Layout.NATIVE: tuple((f, f) for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                                          "ffn_hidden_dim", "rope_theta", "rope_scaling", "tie_embeddings")),
}
_MISSING = object()


def read_config(path: str) -> Optional[Dict[str, Any]]:
    """``path/config.json`` as a dict; None when there is none.

    Raises:
        ValueError: the file is not a JSON object (the file is named).
    """
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            config = json.load(f)
    except ValueError as err:
        raise ValueError(f"{file} is not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} holds a JSON {type(config).__name__}, not an object")
    return config


def hf_rope_scaling(config: Dict[str, Any]) -> Optional[RopeScaling]:
    """The RoPE scaling a ``transformers`` Llama ``config.json`` describes (None: plain RoPE), read
    as transformers does: ``rope_scaling``, else ``rope_parameters``; ``rope_type`` (or the older
    ``type``) ``default`` or ``llama3``.

    Raises:
        ValueError: another rope type, or a llama3 entry without its keys.
    """
    params = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_scaling {params!r} is not an object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(f"rope_type {rope_type!r} is not supported (only 'default' and 'llama3')")
    values = {"original_max_position_embeddings": config.get("max_position_embeddings"), **params}
    missing = [f.name for f in dataclasses.fields(RopeScaling) if values.get(f.name) is None]
    if missing:
        raise ValueError(f"rope_scaling of rope_type 'llama3' lacks {', '.join(missing)}")
    return RopeScaling(**{f.name: values[f.name] for f in dataclasses.fields(RopeScaling)})


def _config_value(config: Dict[str, Any], key: str, layout: Layout) -> Any:
    """``config[key]``, with transformers' defaults for the keys a Llama config may leave out."""
    if key == "rope_scaling":  # missing: plain RoPE (an export from before the key existed)
        stored = config.get(key)
        if layout is Layout.TRANSFORMERS:
            return hf_rope_scaling(config)
        return RopeScaling.from_mapping(stored) if isinstance(stored, dict) else stored
    if layout is Layout.TRANSFORMERS:
        if key == "num_key_value_heads" and config.get(key) is None:
            return config.get("num_attention_heads", _MISSING)
        if key == "rope_theta" and key not in config:
            return (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        if key == "tie_word_embeddings":
            return config.get(key, False)
    return config.get(key, _MISSING)


def _same(stored: Any, ours: Any) -> bool:
    if isinstance(ours, RopeScaling) or isinstance(stored, RopeScaling) or stored is None:
        return stored == ours
    if isinstance(ours, bool) or isinstance(stored, bool):
        return stored is ours
    if isinstance(stored, (int, float)):
        return float(stored) == float(ours)
    return False


def check_config(path: str, cfg: LlamaConfig) -> Layout:
    """The layout of the HF-style directory ``path``, after checking its ``config.json`` (if
    any) describes the model of ``cfg``: without this, a model with other head counts but the
    same tensor shapes would load with its q/k rows permuted for the wrong heads.

    Raises:
        ValueError: ``config.json`` is unreadable, of another architecture, or differs from
            ``cfg`` (one line naming each differing field, the file's value and the model's).
    """
    config = read_config(path)
    if config is None:
        return Layout.NATIVE  # tensor names only: shapes are still checked by the load
    file = os.path.join(path, CONFIG_FILE)
    if config.get("model_type") == "llama":
        layout = Layout.TRANSFORMERS
    elif NATIVE_ARCHITECTURE in (config.get("architectures") or []):
        layout = Layout.NATIVE
    else:
        raise ValueError(f"{file} describes neither a transformers Llama (model_type 'llama', found "
                         f"{config.get('model_type')!r}) nor a {NATIVE_ARCHITECTURE} export")
    differences = []
    for key, field in _CHECKED[layout]:
        try:
            stored, ours = _config_value(config, key, layout), getattr(cfg, field)
        except ValueError as err:
            raise ValueError(f"{file}: {err}") from None
        if not _same(stored, ours):
            shown = "missing" if stored is _MISSING else repr(stored)
            differences.append(f"{key} {shown} vs model.{field}={ours!r}")
    if differences:
        raise ValueError(f"{file} does not describe this model: {'; '.join(differences)} "
                         "(set the model keys to the export's values, or use another init_from)")
    return layout


@torch.no_grad()
def rows_to_interleaved_(param: torch.Tensor, n_heads: int) -> None:
    """Permute the rows of ``param`` (plain or sharded; 2-D, or 1-D such as a per-head norm's
    weight) in place from rotated halves to interleaved rotary pairs, per head (collective for a
    DTensor: the full tensor is gathered)."""
    full = param.full_tensor() if isinstance(param, DTensor) else param.detach().clone()
    fixed = halves_to_interleaved(full.reshape(full.shape[0], -1), n_heads).view_as(full)
    if isinstance(param, DTensor):
        param.to_local().copy_(local_part(fixed, param))
    else:
        param.copy_(fixed)


def load_pretrained(model: nn.Module, path: str, cfg: LlamaConfig) -> Layout:
    """Fill ``model`` (plain or sharded, of ``cfg``) from the HF-style directory ``path``
    (collective): ``transformers`` Llama names and rotary layout when its ``config.json`` says
    ``model_type: llama``, else our names; :func:`check_config` first.

    Returns:
        The directory's layout.

    Raises:
        ValueError: as :func:`check_config`, or a stored shape differs from the model's.
        KeyError / CheckpointError: as :func:`hyper_parallel.checkpoint.load_hf`.
    """
    from hyper_parallel.checkpoint import get_model_state_dict, load_hf

    layout = check_config(path, cfg)
    if layout is Layout.NATIVE:
        load_hf(model, path)
        return layout
    ours = get_model_state_dict(model)
    targets = {hf_name(k): v for k, v in ours.items() if not (k == "output.weight" and cfg.tie_embeddings)}
    load_hf(targets, path)
    for name, tensor in ours.items():
        heads = _heads(name, cfg)
        if heads:
            rows_to_interleaved_(tensor, heads)
    return layout
