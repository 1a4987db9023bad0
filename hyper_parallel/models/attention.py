"""The decoder's self-attention: causal, grouped-query heads, rotary positions, an optional
RMSNorm over each query and key head (Qwen3's), run through ``cp_attention`` (SDPA, or ring
attention under context parallelism)."""

from __future__ import annotations

from typing import Optional, Protocol

import torch
from torch import nn

from hyper_parallel.models.layers import RMSNorm
from hyper_parallel.models.rotary import apply_rope
from hyper_parallel.parallel.context import rope_rows
from hyper_parallel.parallel.ring_attention import cp_attention

__all__ = ["Attention", "AttentionConfig"]


class AttentionConfig(Protocol):
    """The fields :class:`Attention` reads: those of every decoder config (``LlamaConfig``,
    ``MoEConfig``, whose ``head_dim`` may differ from ``dim / n_heads``)."""

    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    norm_eps: float


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads and rotary positions. ``qk_norm``: an
    RMSNorm over each query and key head before the rotation (``q_norm``/``k_norm``, Qwen3's)."""

    q_norm: Optional[RMSNorm]
    k_norm: Optional[RMSNorm]

    def __init__(self, cfg: AttentionConfig, *, qk_norm: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        # -1 head counts keep this correct when tensor parallelism shards the heads.
        q = self.wq(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # Under context parallelism (hyper_parallel.parallel.context) x holds this rank's part of
        # each sequence: RoPE takes the tokens' global positions and attention runs as ring attention.
        cos, sin = rope_rows(cos, sin, seq)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = cp_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))
