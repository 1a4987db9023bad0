"""A Llama-style decoder: RMSNorm, rotary attention through SDPA (with GQA), SwiGLU MLP.

Built so it can be created on the meta device, wrapped with ``fully_shard`` and then
materialised with ``to_empty`` + ``init_weights``. ``layers`` is an ``nn.ModuleDict`` keyed
``"0"``..``"n-1"``, so that a pipeline stage (``hyper_parallel.pipeline.split_stage``) keeps
only its blocks under the full model's parameter names.
"""

from __future__ import annotations

import math
import numbers
import zlib
from dataclasses import dataclass, fields
from typing import Any, Callable, List, Mapping, Optional, Protocol, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from hyper_parallel.chunked_loss import ChunkedLoss
from hyper_parallel.context_parallel import cp_attention, rope_rows
from hyper_parallel.core.layout import local_part


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's frequency-dependent RoPE scaling (``rope_type: llama3`` in ``transformers``).

    Rotary wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are
    stretched by ``factor``, those shorter than ``original_max_position_embeddings /
    high_freq_factor`` are kept, and those between are interpolated smoothly. The defaults are
    Llama 3.1's (Llama 3.2 uses ``factor=32``). The field names are ``transformers``' keys.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "RopeScaling":
        """From a mapping of (some of) the field names, e.g. a ``config.json`` entry.

        Raises:
            ValueError: a key that is not a field.
        """
        names = [f.name for f in fields(cls)]
        unknown = sorted(str(k) for k in values if k not in names)
        if unknown:
            raise ValueError(f"rope_scaling has unknown key(s) {', '.join(unknown)}; known: {', '.join(names)}")
        return cls(**{str(k): v for k, v in values.items()})

    def problems(self) -> List[str]:
        """What is wrong with the values (empty: nothing)."""
        def real(value: Any) -> bool:
            return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)

        found = [f"rope_scaling.{name}={getattr(self, name)!r} must be a finite number > 0"
                 for name in ("factor", "low_freq_factor", "high_freq_factor")
                 if not real(getattr(self, name)) or getattr(self, name) <= 0]
        original = self.original_max_position_embeddings
        if not isinstance(original, numbers.Integral) or isinstance(original, bool) or original < 1:
            found.append(f"rope_scaling.original_max_position_embeddings={original!r} must be a positive integer")
        if found:
            return found
        if self.factor < 1:
            found.append(f"rope_scaling.factor={self.factor!r} must be >= 1 (it stretches wavelengths)")
        if self.low_freq_factor >= self.high_freq_factor:
            found.append(f"rope_scaling.low_freq_factor={self.low_freq_factor!r} must be below "
                         f"rope_scaling.high_freq_factor={self.high_freq_factor!r}")
        return found

    def scale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """The scaled inverse frequencies (the computation of Meta's and ``transformers``' Llama 3.1)."""
        wavelen = 2 * math.pi / inv_freq
        original = self.original_max_position_embeddings
        smooth = (original / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        stretched = torch.where(wavelen > original / self.low_freq_factor, inv_freq / self.factor, smoothed)
        return torch.where(wavelen < original / self.high_freq_factor, inv_freq, stretched)


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: Optional[int] = None  # None: same as n_heads (no grouped-query attention)
    ffn_hidden_dim: Optional[int] = None  # None: the Llama rule from dim
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 256
    tie_embeddings: bool = False
    # None: plain RoPE. A mapping of RopeScaling's fields (e.g. from a JSON or YAML config) is converted.
    rope_scaling: Optional[RopeScaling] = None

    def __post_init__(self) -> None:
        scaling: Union[RopeScaling, Mapping[str, Any], None] = self.rope_scaling
        if isinstance(scaling, Mapping):
            self.rope_scaling = scaling = RopeScaling.from_mapping(scaling)
        if scaling is not None and not isinstance(scaling, RopeScaling):
            raise ValueError(f"rope_scaling={scaling!r} must be null or a mapping of RopeScaling's fields")
        problems = scaling.problems() if scaling is not None else []
        if problems:
            raise ValueError("; ".join(problems))
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.ffn_hidden_dim is None:
            hidden = int(2 * 4 * self.dim / 3)
            self.ffn_hidden_dim = self.multiple_of * math.ceil(hidden / self.multiple_of)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def init_tensor_(param: torch.Tensor, fill: Callable[[torch.Tensor, torch.Generator], object],
                 generator: torch.Generator) -> None:
    """Fill ``param`` with ``fill(tensor, generator)`` drawn for its whole (global) shape on CPU.

    The values depend only on the generator's state and the global shape, never on how the
    parameter is sharded, so every mesh and world size gets the same model.
    """
    full = torch.empty(param.shape, dtype=param.dtype)
    fill(full, generator)
    if isinstance(param, DTensor):
        param.to_local().copy_(local_part(full, param))
    else:
        param.copy_(full)


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in at least float32 (float64 stays float64), for numerically sensitive steps."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = _upcast(x)
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None,
                scaling: Optional[RopeScaling] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim // 2); ``scaling``: Llama 3.1's, if any."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is not None:
        inv_freq = scaling.scale(inv_freq)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]) of x: (batch, heads, seq, head_dim)."""
    x1, x2 = _upcast(x).unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return rotated.type_as(x)


class AttentionConfig(Protocol):
    """The fields :class:`Attention` reads: ``LlamaConfig``, or another model's config
    (``hyper_parallel.models.moe.MoEConfig``, whose ``head_dim`` may differ from ``dim / n_heads``)."""

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
        # Under context parallelism (hyper_parallel.context_parallel) x holds this rank's part of
        # each sequence: RoPE takes the tokens' global positions and attention runs as ring attention.
        cos, sin = rope_rows(cos, sin, seq)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = cp_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


def param_generator(seed: int, fqn: str) -> torch.Generator:
    """The generator that initialises the parameter named ``fqn``: seeded from ``seed`` and a
    stable hash of the name, so a parameter gets the same value whichever other parameters
    the model holds (a pipeline stage has only some blocks)."""
    return torch.Generator().manual_seed((seed % 2**32) << 32 | zlib.crc32(fqn.encode()))


def init_normal_(param: torch.Tensor, seed: int, fqn: str, std: float, *, truncated: bool = True) -> None:
    """Fill the parameter named ``fqn`` (plain or sharded) with normal values of ``std``, truncated
    at 3 ``std`` unless ``truncated=False``, drawn from :func:`param_generator` ``(seed, fqn)``."""
    def fill(t: torch.Tensor, g: torch.Generator) -> None:
        if truncated:
            nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std, generator=g)
        else:
            nn.init.normal_(t, std=std, generator=g)
    init_tensor_(param, fill, param_generator(seed, fqn))


class Transformer(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab).

    A pipeline stage of it (see ``hyper_parallel.pipeline.split_stage``) holds only some of
    ``layers``; ``tok_embeddings`` is None except on the first stage (the input is then the
    hidden state, (batch, seq, dim)), ``norm`` and ``output`` are None except on the last
    (the output is then the hidden state).
    """

    tok_embeddings: Optional[nn.Embedding]
    norm: Optional[RMSNorm]
    output: Optional[nn.Linear]

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: recomputed on materialisation, never checkpointed.
        cos, sin = self._rope_tables(self.tok_embeddings.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _rope_tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, device, self.cfg.rope_scaling)

    @torch.no_grad()
    def init_weights(self, seed: Optional[int] = None) -> None:
        """(Re)initialise every parameter and the RoPE tables, e.g. after ``to_empty``.

        Works on plain and on sharded (DTensor) parameters; each parameter's values depend only
        on ``seed`` (default 0) and its name (:func:`param_generator`), not on the mesh, the
        world size or which other parameters this (stage) model holds. Re-ties the output
        projection to the embedding when ``tie_embeddings`` is set (``to_empty`` unties shared
        parameters).
        """
        seed = 0 if seed is None else seed
        tied = self.cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None
        if tied and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

        def init(fqn: str, param: torch.Tensor, std: float, truncated: bool = True) -> None:
            init_normal_(param, seed, fqn, std, truncated=truncated)

        std = 0.02
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        if self.tok_embeddings is not None:
            emb_std = std if self.cfg.tie_embeddings else 1.0
            init("tok_embeddings.weight", self.tok_embeddings.weight, emb_std, truncated=False)
        for name, layer in self.layers.items():
            attn, ffn = layer.attention, layer.feed_forward
            for path, lin in (("attention.wq", attn.wq), ("attention.wk", attn.wk), ("attention.wv", attn.wv),
                              ("feed_forward.w1", ffn.w1), ("feed_forward.w3", ffn.w3)):
                init(f"layers.{name}.{path}.weight", lin.weight, std)
            for path, lin in (("attention.wo", attn.wo), ("feed_forward.w2", ffn.w2)):
                init(f"layers.{name}.{path}.weight", lin.weight, out_std)
            layer.attention_norm.reset_parameters()
            layer.ffn_norm.reset_parameters()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not self.cfg.tie_embeddings:
            init("output.weight", self.output.weight, self.cfg.dim ** -0.5)
        self.rope_cos, self.rope_sin = self._rope_tables(self.rope_cos.device)

    def forward(self, tokens: torch.Tensor, loss: Optional[ChunkedLoss] = None) -> torch.Tensor:
        """Logits (batch, seq, vocab) of ``tokens`` (or, for a pipeline stage without the output
        layer, the hidden states); with ``loss``, the loss it computes from the last hidden
        states instead, in chunks (the logits never whole)."""
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.output is None:
            return h
        return self.output(self.norm(h)) if loss is None else loss(h, lambda x: self.output(self.norm(x)))

    def num_params(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())


# Named sizes. llama_debug runs on CPU in well under a second per step.
CONFIGS = {
    "llama_debug": dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=256),
    "llama_50m": dict(vocab_size=8192, dim=576, n_layers=10, n_heads=9, max_seq_len=256),
    "llama_1b": dict(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                     ffn_hidden_dim=8192, rope_theta=500000.0, max_seq_len=4096, tie_embeddings=True,
                     rope_scaling=RopeScaling(factor=32.0)),
    "llama_8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                     ffn_hidden_dim=14336, rope_theta=500000.0, max_seq_len=8192),
    "llama_70b": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                      ffn_hidden_dim=28672, rope_theta=500000.0, max_seq_len=8192),
}


def build_llama(name: str = "llama_debug", **overrides) -> Transformer:
    """Build a named model size (see ``CONFIGS``), with field overrides."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; known: {sorted(CONFIGS)}")
    return Transformer(LlamaConfig(**{**CONFIGS[name], **overrides}))
