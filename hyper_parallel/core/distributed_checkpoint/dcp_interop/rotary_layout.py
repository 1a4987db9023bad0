"""Rotary layouts at import (``import-dcp --rotate-half NAME:N_HEADS``).

Our attention rotates interleaved pairs ``(x[2i], x[2i+1])`` of each head, as torchtitan's
Llama 3 and DeepSeek-V3 do (their ``ComplexRoPE``). torchtitan's Qwen3 (dense and MoE, its
``CosSinRoPE``) and ``transformers`` rotate halves ``(x[i], x[i + head_dim/2])``. A query or
key projection trained with halves holds, per head, row ``i`` and row ``i + head_dim/2`` as
one pair; moved to interleaved pairs its rows become ``r[0], r[hd/2], r[1], r[hd/2+1], ...``.
The per-head ``q_norm``/``k_norm`` weights (one head of ``head_dim``) and every optimizer
moment of these tensors get the same permutation, so attention scores and a resumed Adam step
are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from hyper_parallel.core.distributed_checkpoint.dcp_interop.fused_split import Rows
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError

__all__ = ["RotateHalf"]


@dataclass(frozen=True)
class RotateHalf:
    """``--rotate-half NAME:N_HEADS``: every tensor (of one or more dims) whose key has the
    dotted component ``name`` holds ``n_heads`` heads of rotate-half rows along dim 0; they are
    imported as interleaved pairs. 0-dim tensors (Adam's ``step``) and values are kept."""

    name: str
    n_heads: int

    def __post_init__(self) -> None:
        if not self.name or "." in self.name or "*" in self.name:
            raise ValueError(f"--rotate-half NAME {self.name!r} must be one dotted component (e.g. wq)")
        if self.n_heads < 1:
            raise ValueError(f"--rotate-half {self.name}: N_HEADS={self.n_heads} must be at least 1")

    @classmethod
    def parse(cls, text: str) -> "RotateHalf":
        """``NAME:N_HEADS``, e.g. ``wq:32`` or ``q_norm:1``.

        Raises:
            ValueError: anything else (says the expected form).
        """
        name, sep, heads = text.partition(":")
        if not sep or not heads.isdigit():
            raise ValueError(f"--rotate-half takes NAME:N_HEADS (e.g. wq:32, q_norm:1), not {text!r}")
        return cls(name, int(heads))

    def applies(self, key: str) -> bool:
        """Whether ``key`` has the component ``name``."""
        return self.name in key.split(".")

    def permuted(self, rows: Rows, key: str) -> Rows:
        """``rows`` (the row ranges a tensor is made of) in interleaved order, per head.

        Raises:
            CheckpointError: the rows are not ``n_heads`` heads of an even size (names ``key``).
        """
        order: List[int] = [start + i for start, length in rows for i in range(length)]
        if not order or len(order) % (2 * self.n_heads):
            raise CheckpointError(f"cannot move {key!r} ({len(order)} rows on dim 0) from rotated halves to "
                                  f"interleaved pairs: it is not {self.n_heads} heads of an even size; check "
                                  f"--rotate-half {self.name}:{self.n_heads}")
        head, half = len(order) // self.n_heads, len(order) // self.n_heads // 2
        out: List[Tuple[int, int]] = []
        for h in range(self.n_heads):
            base = h * head
            for i in range(half):
                for row in (order[base + i], order[base + half + i]):
                    if out and out[-1][0] + out[-1][1] == row:
                        out[-1] = (out[-1][0], out[-1][1] + 1)
                    else:
                        out.append((row, 1))
        return tuple(out)
