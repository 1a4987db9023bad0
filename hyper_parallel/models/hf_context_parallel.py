"""Context parallelism (``parallel.cp``) for a ``transformers`` causal LM (``model=hf``).

The project's ring attention (:func:`~hyper_parallel.parallel.ring_attention.cp_attention`) is
registered with ``transformers``' attention interface as :data:`RING_ATTENTION`
(``transformers.AttentionInterface``), and :func:`use_ring_attention` makes it the model's
attention implementation (``set_attn_implementation``). Under an active
:func:`~hyper_parallel.parallel.context.context_parallel` each rank's inputs are its part of each
sequence in the context's layout: :func:`position_ids` gives the rotary embedding the tokens'
global positions and the ring applies the causal mask of the whole sequence (``transformers``
builds no mask for an implementation outside its mask interface: the ring's is the only one).
Without a context the same implementation is torch's causal ``scaled_dot_product_attention``.

A model whose attention does not go through the interface, or uses what the ring does not
compute (a sliding window shorter than the sequence, chunked attention, logit soft-capping,
attention dropout, non-attention sequence mixers in its layer types) is refused by
:func:`context_parallel_problems`, one line naming the model and FSDP/HSDP instead.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from hyper_parallel.parallel.context import current_context
from hyper_parallel.parallel.ring_attention import cp_attention

__all__ = ["RING_ATTENTION", "context_parallel_problems", "position_ids", "ring_attention_forward",
           "use_ring_attention"]

#: The name of the ring attention in ``transformers``' attention interface.
RING_ATTENTION = "hyper_parallel_ring"

# The layer types (config.layer_types) whose sequence mixing is attention through the interface.
_ATTENTION_LAYERS = ("full_attention", "sliding_attention")
# Attention arguments (of transformers' own implementations) that change what is computed; the
# ring computes none of them.
_UNSUPPORTED_ARGUMENTS = ("softcap", "s_aux", "sinks", "position_bias")

_INSTEAD = "use FSDP/HSDP (parallel.dp_shard, parallel.dp_replicate)"


def ring_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                           scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                           sliding_window: Optional[int] = None, **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """``transformers``' attention-interface function of :data:`RING_ATTENTION`: ``query``
    ``(batch, heads, seq, head_dim)``, ``key``/``value`` with the model's key/value heads; the
    output ``(batch, seq, heads, head_dim)`` and no weights. Causal as ``module.is_causal`` says
    (over the whole sequence under CP).

    Raises:
        ValueError: an attention mask (padding), dropout, a sliding window shorter than the
            sequence, or another argument the ring does not compute (soft-capping, sinks).
    """
    what = type(module).__name__
    if attention_mask is not None:
        raise ValueError(f"{RING_ATTENTION} attention ({what}) takes no attention mask (it applies the causal "
                         "mask of the whole sequence itself): train on unpadded sequences")
    if dropout:
        raise ValueError(f"{RING_ATTENTION} attention ({what}) has no dropout; got attention dropout {dropout}")
    odd = [name for name in _UNSUPPORTED_ARGUMENTS if kwargs.get(name) is not None]
    if odd:
        raise ValueError(f"{RING_ATTENTION} attention ({what}) does not compute {', '.join(odd)}")
    cp = current_context()
    length = query.shape[2] * (cp.size if cp is not None else 1)
    if sliding_window is not None and sliding_window < length:
        raise ValueError(f"{RING_ATTENTION} attention ({what}) has no sliding window: its window {sliding_window} "
                         f"is shorter than the sequence ({length} tokens)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = cp_attention(query, key, value, is_causal=bool(causal), scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(RING_ATTENTION, ring_attention_forward)


def context_parallel_problems(model: nn.Module, seq_len: Optional[int] = None) -> List[str]:
    """Why the ``transformers`` ``model`` (a :class:`~hyper_parallel.models.hf_causal_lm.CausalLMLogits`,
    meta is fine) cannot run ``parallel.cp`` on sequences of ``seq_len`` tokens, one line each
    (empty: it can). ``seq_len`` None: the sliding window is not checked here (the attention
    checks it on every call)."""
    name, config = model.architecture, model.config.get_text_config()
    if not model.is_backend_compatible():
        return [f"parallel.cp: {name}'s attention does not go through transformers' AttentionInterface (ring "
                f"attention cannot replace it); {_INSTEAD}"]
    found = []
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or ()
    windowed = not layer_types or "sliding_attention" in layer_types
    if seq_len is not None and isinstance(window, int) and window < seq_len and windowed:
        found.append(f"sliding window {window} shorter than training.seq_len={seq_len}")
    others = sorted(set(layer_types) - set(_ATTENTION_LAYERS))
    if others:
        found.append(f"layers that are not attention ({', '.join(others)})")
    for key, what in (("attention_chunk_size", "chunked attention"), ("attn_logit_softcapping", "attention "
                      "logit soft-capping")):
        if getattr(config, key, None) is not None:
            found.append(f"{what} ({key}={getattr(config, key)})")
    if getattr(config, "attention_dropout", 0.0):
        found.append(f"attention dropout ({config.attention_dropout})")
    if found:
        return [f"parallel.cp: ring attention cannot compute {name}'s {'; '.join(found)}; {_INSTEAD}"]
    return []


def use_ring_attention(model: nn.Module) -> None:
    """Make :data:`RING_ATTENTION` the attention of ``model`` (registering it with ``transformers``
    once).

    Raises:
        ValueError: as :func:`context_parallel_problems`.
    """
    problems = context_parallel_problems(model)
    if problems:
        raise ValueError(problems[0])
    _register()
    model.set_attn_implementation(RING_ATTENTION)


def position_ids(model: nn.Module, input_ids: torch.Tensor) -> Optional[torch.Tensor]:
    """The position ids ``(1, local_len)`` of ``input_ids`` ``(batch, local_len)`` under an active
    :func:`~hyper_parallel.parallel.context.context_parallel`: the global positions of the
    tokens this rank holds; None without one (``transformers`` counts from 0).

    Raises:
        ValueError: under a context, ``model``'s attention is not :data:`RING_ATTENTION`
            (it would attend within this rank's tokens only).
    """
    cp = current_context()
    if cp is None:
        return None
    implementation = model.config._attn_implementation
    if implementation != RING_ATTENTION:
        raise ValueError(f"{model.architecture} runs under context_parallel with {implementation!r} attention, "
                         f"which sees this rank's tokens only: call use_ring_attention(model) first")
    return cp.positions(input_ids.shape[1], input_ids.device).unsqueeze(0)
