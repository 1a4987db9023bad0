"""The one decoder every model family configures: a token embedding, blocks (attention, then a
feed-forward, each behind an RMSNorm and a residual), a final RMSNorm and an output
projection, the rotary tables, and the seeded initialisation that gives each parameter the
same value on any mesh, world size or pipeline stage.

A model family chooses the feed-forward of each block, by its :class:`DecoderBlock` subclass:
the dense SwiGLU (``llama.TransformerBlock``) or a mixture of experts (``moe.MoEBlock``).
Everything else (names, initialisation, the pipeline stage split and the tensor-parallel plan
in ``llama_parallel``, context parallelism through :class:`~hyper_parallel.models.attention.Attention`)
is shared.

Built so it can be created on the meta device, wrapped with ``fully_shard`` and then
materialised with ``to_empty`` + ``init_weights``. ``layers`` is an ``nn.ModuleDict`` keyed
``"0"``..``"n-1"``, so that a pipeline stage (``llama_parallel.split_stage``) keeps only its
blocks under the full model's parameter names.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hyper_parallel.chunked_loss import ChunkedLoss
from hyper_parallel.core.distributed_checkpoint.state_dict import canonical_fqn
from hyper_parallel.core.layout import local_part
from hyper_parallel.models.attention import Attention, AttentionConfig
from hyper_parallel.models.contract import RecipeModel
from hyper_parallel.models.layers import RMSNorm
from hyper_parallel.models.rotary import RopeScaling, rope_tables

__all__ = ["Decoder", "DecoderBlock", "DecoderConfig", "DecoderSizes", "init_normal_", "init_tensor_", "name_seed",
           "param_generator"]


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


def name_seed(seed: int, name: str) -> int:
    """A stable 32-bit hash of ``seed`` and a parameter's or module's ``name`` (torch's CPU
    generator keeps only the low 32 bits of a seed, so ``seed`` cannot sit in the high ones)."""
    return zlib.crc32(f"{seed}:{name}".encode())


def param_generator(seed: int, fqn: str) -> torch.Generator:
    """The generator that initialises the parameter named ``fqn``: seeded from ``seed`` and the
    name (:func:`name_seed`), so a parameter gets the same value whichever other parameters
    the model holds (a pipeline stage has only some blocks)."""
    return torch.Generator().manual_seed(name_seed(seed, fqn))


def init_normal_(param: torch.Tensor, seed: int, fqn: str, std: float, *, truncated: bool = True) -> None:
    """Fill the parameter named ``fqn`` (plain or sharded) with normal values of ``std``, truncated
    at 3 ``std`` unless ``truncated=False``, drawn from :func:`param_generator` ``(seed, fqn)``."""
    def fill(t: torch.Tensor, g: torch.Generator) -> None:
        if truncated:
            nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std, generator=g)
        else:
            nn.init.normal_(t, std=std, generator=g)
    init_tensor_(param, fill, param_generator(seed, fqn))


@dataclass
class DecoderSizes:
    """The fields every decoder config starts with (``LlamaConfig``, ``MoEConfig``)."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: Optional[int] = None  # None: same as n_heads (no grouped-query attention)


class DecoderConfig(AttentionConfig, Protocol):
    """The fields :class:`Decoder` reads (``LlamaConfig`` and ``MoEConfig`` have them all)."""

    vocab_size: int
    n_layers: int
    rope_theta: float
    max_seq_len: int
    tie_embeddings: bool


class DecoderBlock(nn.Module):
    """``x + attention(attention_norm(x))``, then ``+ feed_forward(ffn_norm(x))``. A subclass
    registers its feed-forward (under its own name: the name is in the checkpoint's keys) and
    returns it from :meth:`feed_forward_layer`."""

    def __init__(self, cfg: AttentionConfig, *, qk_norm: bool = False):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg, qk_norm=qk_norm)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def feed_forward_layer(self) -> nn.Module:
        """The module this block's feed-forward runs: ``[..., dim] -> [..., dim]``."""
        raise NotImplementedError(f"{type(self).__name__} must say which feed-forward it runs")

    def reset_buffers(self) -> None:
        """Reset the feed-forward's running state, if any (``init_weights`` calls it)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward_layer()(self.ffn_norm(x))


class Decoder(nn.Module, RecipeModel):
    """Token ids (batch, seq) -> logits (batch, seq, vocab); a
    :class:`~hyper_parallel.models.contract.RecipeModel` (a family supplies its tensor-parallel plan).

    Args:
        cfg: the model's shape.
        block: the block of each layer index (the family's :class:`DecoderBlock`).
        rope_scaling: Llama 3.1's RoPE frequency scaling, if any.

    A pipeline stage of it (see ``llama_parallel.split_stage``) holds only some of ``layers``;
    ``tok_embeddings`` is None except on the first stage (the input is then the hidden state,
    (batch, seq, dim)), ``norm`` and ``output`` are None except on the last (the output is
    then the hidden state).
    """

    tok_embeddings: Optional[nn.Embedding]
    norm: Optional[RMSNorm]
    output: Optional[nn.Linear]

    def __init__(self, cfg: DecoderConfig, block: Callable[[int], DecoderBlock], *,
                 rope_scaling: Optional[RopeScaling] = None):
        super().__init__()
        self.cfg = cfg
        self.rope_scaling = rope_scaling
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): block(i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Non-persistent: recomputed on materialisation, never checkpointed.
        cos, sin = self._rope_tables(self.tok_embeddings.weight.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def _rope_tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, device, self.rope_scaling)

    @torch.no_grad()
    def init_weights(self, seed: Optional[int] = None) -> None:
        """(Re)initialise every parameter and buffer, e.g. after ``to_empty``.

        Works on plain and on sharded (DTensor) parameters; each parameter's values depend only
        on ``seed`` (default 0) and its name (:func:`param_generator`), not on the mesh, the
        world size or which other parameters this (stage) model holds: truncated normals of
        std 0.02, ``wo`` and ``w2`` (dense or experts') ``0.02 / sqrt(2 n_layers)``, norms ones,
        biases zeros, the embedding std 1 (0.02 when tied), the output ``dim ** -0.5``. Re-ties
        the output projection to the embedding when ``tie_embeddings`` is set (``to_empty``
        unties shared parameters).
        """
        seed = 0 if seed is None else seed
        cfg = self.cfg
        if cfg.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight
        std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.n_layers)
        if self.tok_embeddings is not None:
            init_normal_(self.tok_embeddings.weight, seed, "tok_embeddings.weight", std if cfg.tie_embeddings else 1.0,
                         truncated=False)
        for name, block in self.layers.items():
            for path, param in block.named_parameters():
                if path.endswith("norm.weight"):
                    nn.init.ones_(param)
                elif path.endswith("bias"):
                    nn.init.zeros_(param)
                else:
                    wide = path.endswith(("wo.weight", "w2.weight", ".w2"))
                    # (named without wrapper segments: a torch.compile'd block's _orig_mod)
                    init_normal_(param, seed, canonical_fqn(f"layers.{name}.{path}"), out_std if wide else std)
            block.reset_buffers()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not cfg.tie_embeddings:
            init_normal_(self.output.weight, seed, "output.weight", cfg.dim ** -0.5)
        self.rope_cos, self.rope_sin = self._rope_tables(self.rope_cos.device)

    def init_from_seed(self, seed: int) -> None:
        """:meth:`init_weights` (the recipe's contract)."""
        self.init_weights(seed)

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
