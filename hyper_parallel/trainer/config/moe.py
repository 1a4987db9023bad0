"""The ``model.moe`` keys: a mixture of experts in place of each block's MLP (the model is then
:class:`~hyper_parallel.models.moe.MoETransformer`, Qwen3-MoE-shaped; null: a Llama)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, List, Optional, Protocol

from hyper_parallel.models import hf_moe
from hyper_parallel.models.moe import MoEConfig
from hyper_parallel.trainer.config.rules import key


@dataclass
class MoEOptions:
    """``model.moe``: the routed experts of each MoE block (the other shape keys are the model's)."""

    num_experts: int = key(8, min=1)           # routed experts per MoE block
    top_k: int = key(2, min=1)                 # experts each token is sent to (at most num_experts)
    moe_ffn_dim: int = key(64, min=1)          # each expert's SwiGLU hidden size
    shared_experts: int = key(0, min=0)        # always-on experts (one SwiGLU of shared_experts x moe_ffn_dim)
    norm_topk_prob: bool = key(True)           # renormalise the chosen experts' probabilities to sum to 1
    # Load-balancing loss weight, added to the training loss (0: none). At most 1: the loss is 1 per
    # MoE block when balanced (up to num_experts / top_k), so a larger weight outweighs the language
    # model's loss (published models use 1e-3 to 1e-2).
    aux_loss_weight: float = key(0.01, min=0, max=1)
    router_bias: bool = key(False)             # a learned bias in each router's gate
    first_k_dense: int = key(0, min=0)         # the first blocks keep a dense MLP of model.ffn_hidden_dim
    # DeepSeek-V3's loss-free balancing step after each update (0: none; DeepSeek-V3 uses 0.001). Below
    # 0.5: the bias is added to probabilities in [0, 1], and one update moves two experts' biases
    # 2 x rate apart, so from 0.5 on a single update overrides every choice of the router.
    expert_bias_update_rate: float = key(0.0, min=0, max=0.5, max_open=True)
    head_dim: Optional[int] = key(None, min=2)  # the MoE model's attention head size (null: dim / n_heads)
    qk_norm: bool = key(True)                  # the MoE model's attention: Qwen3's RMSNorm over each query/key head


class ModelKeys(Protocol):
    """What this module reads of the ``model`` group (``model.ModelConfig``, which imports this
    module: a declared shape instead of an import back)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: Optional[int]
    max_seq_len: int
    rope_theta: float
    tie_embeddings: bool
    ffn_hidden_dim: Optional[int]
    rope_scaling: Optional[Any]
    init_from: Optional[str]
    moe: Optional[MoEOptions]


# The model keys an MoE model takes from the ``model`` group besides ``model.moe``.
SHARED_KEYS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len", "rope_theta",
               "tie_embeddings")


def moe_config(model: ModelKeys) -> MoEConfig:
    """The ``MoEConfig`` of a ``model`` group whose ``moe`` is set (``ffn_hidden_dim`` null: 0,
    no dense blocks).

    Raises:
        ValueError: inconsistent values (e.g. ``top_k`` above ``num_experts``), in one line.
    """
    return MoEConfig(**{name: getattr(model, name) for name in SHARED_KEYS},
                     ffn_hidden_dim=model.ffn_hidden_dim or 0, **asdict(model.moe))


def moe_problems(model: ModelKeys) -> List[str]:
    """What an MoE ``model`` group cannot be: one line each (what the recipe does not support
    with experts, ``MoEConfig``'s own checks between keys, and with ``model.init_from`` what a
    transformers Qwen3-MoE directory cannot hold)."""
    problems = [f"model.rope_scaling={model.rope_scaling} is not supported with model.moe (the MoE model "
                "has plain RoPE); remove it"] if model.rope_scaling is not None else []
    if model.moe.first_k_dense >= model.n_layers:
        return [*problems, f"model.moe.first_k_dense={model.moe.first_k_dense} leaves no MoE block of the "
                           f"model.n_layers={model.n_layers}: it must be less than n_layers (model.moe=null is a "
                           "dense model)"]
    try:
        cfg = moe_config(model)
    except (ValueError, TypeError) as err:
        return [*problems, f"model.moe: {err}"]
    if model.init_from is not None:
        problems += [f"model.init_from={model.init_from}: {line} (it loads a transformers Qwen3-MoE directory)"
                     for line in hf_moe.unsupported(cfg)]
    return problems
