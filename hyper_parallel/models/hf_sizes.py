"""What a ``transformers`` causal LM costs, read from the model itself (on the meta device) rather
than from a Llama of its sizes: its parameters by decoder layer and root (the memory estimate)
and its training FLOPs per token (throughput and MFU).

The FLOP count follows the convention of the project's own models (``6 x`` the parameters a token
goes through in a matrix multiply, plus the attention scores and values; recomputation not
counted), here counted over the model's modules: every 2-D weight outside the embeddings (each
linear, a router, the output head even when tied), routed experts' 3-D weights at
``num_experts_per_tok / experts`` of their size, and each attention layer at its own query/key and
value head sizes (latent attention's differ) over ``min(window, seq_len)`` keys for a
sliding-window layer.
"""

from __future__ import annotations

from typing import Any, List, NamedTuple

from torch import nn

from hyper_parallel.models.contract import RecipeModel

__all__ = ["BlockSizes", "block_sizes", "flops_per_token", "matmul_params"]

_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


class BlockSizes(NamedTuple):
    """Parameter counts of a model sharded block by block."""

    parameters: int  # the whole model
    root: int        # outside the blocks (embeddings, final norm, output head)
    largest: int     # the largest block


def block_sizes(model: RecipeModel) -> BlockSizes:
    """``model``'s parameter counts (each tensor once, tied ones too) by block and root."""
    total = sum(p.numel() for p in model.parameters())  # type: ignore[attr-defined]
    blocks = [sum(p.numel() for p in block.parameters()) for block in model.layers.values()]
    return BlockSizes(total, total - sum(blocks), max(blocks, default=0))


def matmul_params(model: nn.Module) -> int:
    """Parameters a token goes through in a matrix multiply: every 2-D weight of a module that is
    not an embedding (a tied output head counted as the head), and 3-D routed experts' weights
    scaled by ``num_experts_per_tok / experts`` (dim 0)."""
    text = model.config.get_text_config()  # type: ignore[attr-defined]
    top_k = getattr(text, "num_experts_per_tok", None)
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        for param in module.parameters(recurse=False):
            if param.ndim == 2:
                count += param.numel()
            elif param.ndim == 3 and top_k:
                count += param.numel() * min(top_k, param.shape[0]) // param.shape[0]
    return count


def _attention_keys(text: Any, seq_len: int) -> List[int]:
    """For each decoder layer, the keys a query attends to (0: not an attention layer)."""
    n_layers = text.num_hidden_layers
    declared = getattr(text, "layer_types", None)
    layer_types = declared or ["full_attention"] * n_layers
    window = getattr(text, "sliding_window", None)
    uniform_window = declared is None and window  # e.g. Mistral: every layer slides
    keys = []
    for kind in layer_types:
        if kind not in _ATTENTION_LAYER_TYPES:
            keys.append(0)
        elif window and (kind == "sliding_attention" or uniform_window):
            keys.append(min(window, seq_len))
        else:
            keys.append(seq_len)
    return keys


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token of ``model`` (a ``transformers`` causal LM) on ``seq_len`` tokens:
    ``6 x matmul_params`` plus, per attention layer, ``6 x heads x (qk_head_dim + v_head_dim) x
    keys`` (scores and values, forward and backward)."""
    text = model.config.get_text_config()  # type: ignore[attr-defined]
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    qk, v = getattr(text, "qk_head_dim", None) or head_dim, getattr(text, "v_head_dim", None) or head_dim
    attention = sum(6.0 * text.num_attention_heads * (qk + v) * keys for keys in _attention_keys(text, seq_len))
    return 6.0 * matmul_params(model) + attention
