"""The ``model.moe`` keys: a mixture of experts in place of each block's MLP (the model is then
:class:`~hyper_parallel.models.moe.MoETransformer`, Qwen3-MoE-shaped; null: a Llama)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, List, Optional, Protocol

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
    aux_loss_weight: float = key(0.01, min=0)  # load-balancing loss weight, added to the training loss (0: none)
    router_bias: bool = key(False)             # a learned bias in each router's gate
    first_k_dense: int = key(0, min=0)         # the first blocks keep a dense MLP of model.ffn_hidden_dim
    expert_bias_update_rate: float = key(0.0, min=0)  # DeepSeek-V3's loss-free balancing step after each update (0: none)
    head_dim: Optional[int] = key(None, min=2)  # the MoE model's attention head size (null: dim / n_heads)
    qk_norm: bool = key(True)                  # the MoE model's attention: Qwen3's RMSNorm over each query/key head


class ModelKeys(Protocol):
    """What this module reads of the ``model`` group (``schema.ModelConfig``, which imports this
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
    with experts, and ``MoEConfig``'s own checks between keys)."""
    problems = [f"model.{name}={getattr(model, name)} is not supported with model.moe (the MoE model "
                f"has {what}); remove it" for name, what in (("rope_scaling", "plain RoPE"),
                                                             ("init_from", "no HF import yet"))
                if getattr(model, name) is not None]
    try:
        moe_config(model)
    except (ValueError, TypeError) as err:
        problems.append(f"model.moe: {err}")
    return problems
