"""Llama: the decoder (``hyper_parallel.models.decoder``) with a dense SwiGLU feed-forward in
every block, its config (:class:`LlamaConfig`, with Llama 3.1's RoPE scaling) and named sizes
(:data:`CONFIGS`, :func:`build_llama`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from torch.distributed.device_mesh import DeviceMesh

from hyper_parallel.models import llama_parallel
from hyper_parallel.models.decoder import Decoder, DecoderBlock, DecoderSizes
from hyper_parallel.models.layers import FeedForward
from hyper_parallel.models.rotary import RopeScaling, apply_rope, rope_tables

# RopeScaling (a LlamaConfig field), apply_rope and rope_tables are also importable from here.
__all__ = ["CONFIGS", "LlamaConfig", "RopeScaling", "Transformer", "TransformerBlock", "apply_rope", "build_llama",
           "rope_tables"]


@dataclass
class LlamaConfig(DecoderSizes):
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


class TransformerBlock(DecoderBlock):
    """The decoder block with a dense SwiGLU (``feed_forward``)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden_dim)

    def feed_forward_layer(self) -> FeedForward:
        return self.feed_forward


class Transformer(Decoder):
    """The Llama decoder: token ids (batch, seq) -> logits (batch, seq, vocab); see
    :class:`~hyper_parallel.models.decoder.Decoder` (pipeline stages, ``init_weights``)."""

    cfg: LlamaConfig

    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg, lambda layer: TransformerBlock(cfg), rope_scaling=cfg.rope_scaling)

    def apply_tensor_parallel(self, tp_mesh: DeviceMesh) -> None:
        """The Megatron-style plan, logits sharded over the vocabulary
        (:func:`hyper_parallel.models.llama_parallel.apply_tensor_parallel`)."""
        llama_parallel.apply_tensor_parallel(self, tp_mesh)


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
