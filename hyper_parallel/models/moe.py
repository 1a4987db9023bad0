"""A Qwen3-MoE-shaped model: the decoder (``hyper_parallel.models.decoder``; its attention
optionally with Qwen3's per-head q/k norm) with a mixture of experts
(``hyper_parallel.models.moe_layer``) in place of the dense SwiGLU, after ``first_k_dense``
dense blocks; its config (:class:`MoEConfig`), named sizes (:data:`MOE_CONFIGS`,
:func:`build_moe`), parameter counts and memory per rank.

Like :class:`~hyper_parallel.models.llama.Transformer` it can be created on the meta device,
wrapped with ``fully_shard`` and materialised with ``to_empty`` + ``init_weights``; ``layers``
is an ``nn.ModuleDict`` keyed ``"0"``..``"n-1"``. Load balancing: the auxiliary loss
(``aux_loss_weight``; each MoE layer attaches it to its output, so the backward of the loss
includes it: declare the loss's scale with :meth:`MoETransformer.set_aux_loss_scale`) and/or
DeepSeek-V3's loss-free expert bias (``expert_bias_update_rate``; call
:meth:`MoETransformer.update_expert_bias` after each optimizer step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from hyper_parallel.models.decoder import Decoder, DecoderBlock, DecoderSizes
from hyper_parallel.models.layers import FeedForward
from hyper_parallel.models.moe_layer import MoE, checked_aux_loss_scale
from hyper_parallel.parallel.expert import ExpertParallel

__all__ = ["MOE_CONFIGS", "MemoryPerRank", "MoEBlock", "MoEConfig", "MoETransformer", "ParamCounts",
           "STATE_BYTES_PER_PARAM", "build_moe", "memory_per_rank", "param_counts"]


@dataclass
class MoEConfig(DecoderSizes):
    """The shape of a :class:`MoETransformer`. Fields shared with ``LlamaConfig`` mean the same."""

    dim: int = 32
    head_dim: Optional[int] = None     # None: dim // n_heads (Qwen3 sets it explicitly)
    qk_norm: bool = True               # Qwen3's RMSNorm over each query/key head
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_seq_len: int = 256
    tie_embeddings: bool = False
    num_experts: int = 8
    top_k: int = 2
    moe_ffn_dim: int = 64              # each routed expert's SwiGLU hidden size
    shared_experts: int = 0            # shared experts, fused into one SwiGLU of shared_experts * moe_ffn_dim
    norm_topk_prob: bool = True        # renormalise the chosen experts' probabilities to sum to 1
    aux_loss_weight: float = 0.0       # weight of the load-balancing loss (0: not computed)
    router_bias: bool = False          # a learned bias in the router's gate
    expert_bias_update_rate: float = 0.0  # DeepSeek-V3's loss-free balancing step (0: no expert_bias)
    first_k_dense: int = 0             # the first blocks have a dense SwiGLU of ffn_hidden_dim instead
    ffn_hidden_dim: int = 0            # the dense blocks' hidden size (needed when first_k_dense > 0)

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None and self.n_heads >= 1 and self.dim % self.n_heads == 0:
            self.head_dim = self.dim // self.n_heads
        problems = self.problems()
        if problems:
            raise ValueError("; ".join(problems))

    def problems(self) -> List[str]:
        """What is wrong with the values (empty: nothing)."""
        found = [f"{name}={getattr(self, name)!r} must be an integer >= {low}"
                 for name, low in (("vocab_size", 1), ("dim", 1), ("n_layers", 1), ("n_heads", 1), ("n_kv_heads", 1),
                                   ("num_experts", 1), ("top_k", 1), ("moe_ffn_dim", 1), ("shared_experts", 0),
                                   ("first_k_dense", 0), ("ffn_hidden_dim", 0), ("max_seq_len", 1))
                 if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int)
                 or getattr(self, name) < low]
        if found:
            return found
        if self.head_dim is None:
            found.append(f"dim={self.dim} is not divisible by n_heads={self.n_heads}; set head_dim")
        elif self.head_dim < 2 or self.head_dim % 2:
            found.append(f"head_dim={self.head_dim} must be an even integer >= 2 (rotary pairs)")
        if self.n_heads % self.n_kv_heads:
            found.append(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.top_k > self.num_experts:
            found.append(f"top_k={self.top_k} is more than num_experts={self.num_experts}")
        if self.first_k_dense > self.n_layers:
            found.append(f"first_k_dense={self.first_k_dense} is more than n_layers={self.n_layers}")
        if self.first_k_dense and not self.ffn_hidden_dim:
            found.append(f"first_k_dense={self.first_k_dense} dense blocks need ffn_hidden_dim > 0")
        for name in ("aux_loss_weight", "expert_bias_update_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                found.append(f"{name}={value!r} must be a finite number >= 0")
        return found


class MoEBlock(DecoderBlock):
    """The decoder block with either a dense SwiGLU (``feed_forward``, the first
    ``first_k_dense`` blocks) or a mixture of experts (``moe``)."""

    feed_forward: Optional[FeedForward]
    moe: Optional[MoE]

    def __init__(self, cfg: MoEConfig, layer: int):
        super().__init__(cfg, qk_norm=cfg.qk_norm)
        dense = layer < cfg.first_k_dense
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim) if dense else None
        self.moe = None if dense else MoE(
            cfg.dim, cfg.moe_ffn_dim, cfg.num_experts, cfg.top_k, norm_topk_prob=cfg.norm_topk_prob,
            shared_hidden_dim=cfg.shared_experts * cfg.moe_ffn_dim, router_bias=cfg.router_bias,
            expert_bias=cfg.expert_bias_update_rate > 0, aux_loss_weight=cfg.aux_loss_weight)

    def feed_forward_layer(self) -> nn.Module:
        return self.feed_forward if self.moe is None else self.moe

    def reset_buffers(self) -> None:
        if self.moe is not None:
            self.moe.reset_buffers()


# Why a mixture of experts refuses tensor parallelism (here and in llama_parallel.apply_tensor_parallel).
NO_TENSOR_PARALLEL_PLAN = "the MoE model has no tensor-parallel plan: shard its experts with expert parallelism"


class MoETransformer(Decoder):
    """The mixture-of-experts decoder: token ids (batch, seq) -> logits (batch, seq, vocab), with
    the module names of :class:`~hyper_parallel.models.llama.Transformer` outside the blocks
    (see :class:`~hyper_parallel.models.decoder.Decoder`: pipeline stages, ``init_weights``,
    which gives the experts the dense SwiGLU's values scheme and the routers' gates std 0.02)."""

    cfg: MoEConfig
    replays_routing = True
    blocks_compile_fullgraph = False  # the experts' split of the tokens has data-dependent sizes
    balances_load_over_ranks = True

    def __init__(self, cfg: MoEConfig):
        super().__init__(cfg, lambda layer: MoEBlock(cfg, layer))

    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None:
        """Refused (see :data:`NO_TENSOR_PARALLEL_PLAN`).

        Raises:
            ValueError: always.
        """
        raise ValueError(f"{type(self).__name__}: {NO_TENSOR_PARALLEL_PLAN}")

    def apply_expert_parallel(self, ep_mesh: DeviceMesh) -> List[nn.Module]:
        """Each MoE layer's routed experts split over ``ep_mesh`` by
        :class:`~hyper_parallel.parallel.expert.ExpertParallel`; the experts modules.

        Raises:
            ValueError: as :class:`~hyper_parallel.parallel.expert.ExpertParallel` (e.g. the
                experts do not divide over the mesh).
        """
        experts = [moe.experts for moe in self.moe_layers().values()]
        for module in experts:
            parallelize_module(module, ep_mesh, ExpertParallel())
        return experts

    def moe_layers(self) -> Dict[str, MoE]:
        """The MoE layers by block name (the dense blocks have none)."""
        return {name: block.moe for name, block in self.layers.items() if block.moe is not None}

    def aux_loss(self) -> torch.Tensor:
        """``aux_loss_weight`` times the sum over the MoE layers of their load-balancing loss in
        the last forward: a detached 0-dim tensor, for metrics (the backward of a loss computed
        from the output already includes it: see :meth:`set_aux_loss_scale`); 0 when
        ``aux_loss_weight`` is 0 or the model (a pipeline stage) holds no MoE layer."""
        losses = [moe.balance_loss for moe in self.moe_layers().values() if moe.balance_loss is not None]
        if not losses:
            return torch.zeros((), device=self.rope_cos.device)
        return self.cfg.aux_loss_weight * torch.stack(losses).sum()

    def set_aux_loss_scale(self, scale: float) -> None:
        """Declare the factor the training loss is multiplied by before ``backward`` (default 1:
        ``loss.backward()``; ``1 / grad_accum`` for ``(loss / grad_accum).backward()``; under a
        pipeline schedule ``1 / (microbatches x grad_accum)``). Each MoE layer's output carries
        its weighted balancing loss times ``scale`` (:func:`~hyper_parallel.models.moe_layer.attach_aux_loss`),
        so the gradients are those of ``scale x (loss + aux_loss())`` without adding anything to
        the loss. Set it before the forward.

        Raises:
            ValueError: ``scale`` is not a finite number > 0.
        """
        scale = checked_aux_loss_scale(scale)
        for moe in self.moe_layers().values():
            moe.set_aux_loss_scale(scale)

    def set_balance_group(self, group: Optional[dist.ProcessGroup]) -> None:
        """Balance each forward's tokens together with those of ``group``'s ranks, which hold
        the other parts of the same global micro-batch (the data-parallel ranks, x CP), as one
        forward of that micro-batch would (:meth:`MoE.set_balance_group`); None (default): each
        forward balances its own. Each rank's :meth:`aux_loss` is then ``group size x`` its
        share, whose mean over the group is the global micro-batch's loss."""
        for moe in self.moe_layers().values():
            moe.set_balance_group(group)

    def tokens_per_expert(self) -> Dict[str, torch.Tensor]:
        """Per MoE block name: the ``(token, expert)`` pairs each expert got in the last forward
        (int64, ``[num_experts]``; each sums to tokens x ``top_k``)."""
        return {name: moe.tokens_per_expert for name, moe in self.moe_layers().items()}

    def update_expert_bias(self, group: Optional[dist.ProcessGroup] = None) -> None:
        """After each optimizer step: move every MoE layer's ``expert_bias`` by
        ``expert_bias_update_rate`` towards balance (:meth:`MoE.update_expert_bias`), from the
        token counts of the forwards since the last call, summed over ``group`` (default: every
        rank when a process group is initialised; with pipeline stages pass the data-parallel
        group). Collective over ``group``.

        Raises:
            ValueError: ``expert_bias_update_rate`` is 0 (there is no expert bias).
        """
        rate = self.cfg.expert_bias_update_rate
        if rate <= 0:
            raise ValueError("update_expert_bias needs expert_bias_update_rate > 0 in the model's MoEConfig")
        if group is None and dist.is_initialized():
            group = dist.group.WORLD
        for moe in self.moe_layers().values():
            moe.update_expert_bias(rate, group)

class ParamCounts(NamedTuple):
    """Parameter counts of a model shape."""

    total: int      # every parameter (a tied embedding once)
    active: int     # those one token's forward uses: all but the routed experts it is not sent to
    embedding: int  # the input embedding table (a lookup: one row per token)


def _meta_model(cfg: MoEConfig) -> MoETransformer:
    with torch.device("meta"):
        return MoETransformer(cfg)


def param_counts(cfg: MoEConfig) -> ParamCounts:
    """The counts of ``cfg``'s model, from its shapes (the model is built on the meta device)."""
    model = _meta_model(cfg)
    total = model.num_params()
    per_expert = 3 * cfg.dim * cfg.moe_ffn_dim
    idle = (cfg.num_experts - cfg.top_k) * per_expert * len(model.moe_layers())
    return ParamCounts(total=total, active=total - idle, embedding=cfg.vocab_size * cfg.dim)


#: fp32 parameter + fp32 gradient + AdamW's two fp32 moments.
STATE_BYTES_PER_PARAM = 16


class MemoryPerRank(NamedTuple):
    """Bytes one rank holds for the model in training, from the shapes alone (activations not counted)."""

    model_state: int  # its shard of the parameters, gradients and AdamW moments (fp32)
    blocks: int       # two blocks gathered in bf16 (the running one and the prefetched one)
    root: int         # the root group gathered in bf16 (embedding, final norm, output)

    @property
    def total(self) -> int:
        return self.model_state + self.blocks + self.root


def memory_per_rank(cfg: MoEConfig, ranks: int, ep: int = 1) -> MemoryPerRank:
    """The memory of training ``cfg``'s model with AdamW on ``ranks`` ranks, every block and the
    root under ``fully_shard`` over all of them, and with ``ep > 1`` the routed experts
    split over ``ep`` expert-parallel ranks (each group of ``ep`` ranks holds all experts
    once; ``fully_shard`` shards each rank's experts over the ``ranks / ep`` groups). Either
    way every parameter is split ``ranks`` ways; expert parallelism shrinks what a block
    gathers (its experts are gathered over ``ranks / ep`` ranks only).

    Raises:
        ValueError: ``ep`` does not divide ``ranks`` and ``num_experts``.
    """
    if ranks < 1 or ep < 1 or ranks % ep or cfg.num_experts % ep:
        raise ValueError(f"expert parallelism {ep} must divide the {ranks} ranks and num_experts={cfg.num_experts}")
    model = _meta_model(cfg)
    experts = {id(p) for moe in model.moe_layers().values() for p in moe.experts.parameters()}
    blocks = [sum(p.numel() // (ep if id(p) in experts else 1) for p in block.parameters())
              for block in model.layers.values()]
    root = model.num_params() - sum(p.numel() for p in model.layers.parameters())
    return MemoryPerRank(model_state=STATE_BYTES_PER_PARAM * model.num_params() // ranks,
                         blocks=2 * 2 * max(blocks), root=2 * root)


# Named sizes. moe_debug runs on CPU in well under a second per step.
MOE_CONFIGS = {
    "moe_debug": dict(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, num_experts=8, top_k=2,
                      moe_ffn_dim=64, max_seq_len=256, aux_loss_weight=0.01),
    # Qwen3-30B-A3B: 48 MoE blocks of 128 experts (8 active), GQA with head_dim 128 and q/k norm.
    "qwen3_30b_a3b": dict(vocab_size=151936, dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                          num_experts=128, top_k=8, moe_ffn_dim=768, norm_topk_prob=True, rope_theta=1e6,
                          max_seq_len=4096, aux_loss_weight=0.001),
    # DeepSeek-V2-Lite's shape with DeepSeek-V3's loss-free balancing (~16B total, 2.4B active):
    # one dense block, then 64 experts (6 active) + 2 shared. GQA (8 key/value heads) stands in
    # for multi-head latent attention, with about as many parameters.
    "deepseek_v3_16b": dict(vocab_size=102400, dim=2048, n_layers=27, n_heads=16, n_kv_heads=8, head_dim=128,
                            qk_norm=False, num_experts=64, top_k=6, moe_ffn_dim=1408, shared_experts=2,
                            norm_topk_prob=False, first_k_dense=1, ffn_hidden_dim=10944, rope_theta=10000.0,
                            max_seq_len=4096, expert_bias_update_rate=0.001),
}


def build_moe(name: str = "moe_debug", **overrides) -> MoETransformer:
    """Build a named MoE size (see ``MOE_CONFIGS``), with field overrides.

    Raises:
        ValueError: unknown name, or the fields' values are invalid (one line).
    """
    if name not in MOE_CONFIGS:
        raise ValueError(f"unknown MoE model {name!r}; known: {sorted(MOE_CONFIGS)}")
    return MoETransformer(MoEConfig(**{**MOE_CONFIGS[name], **overrides}))
