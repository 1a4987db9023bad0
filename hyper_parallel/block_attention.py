"""Attention over one block of keys/values, returning its log-sum-exp, and the exact merge of
such partial results: the pieces ring attention (``hyper_parallel.context_parallel``) is made of.

Plain torch ops (any device, any dtype; at least float32 inside). Grouped-query attention: the
query heads are grouped over the key/value heads, K/V are broadcast, never expanded into a copy.
"""

from __future__ import annotations

import enum
from typing import Optional, Tuple

import torch

__all__ = ["BlockMask", "accumulation_dtype", "block_attention", "block_attention_backward", "merge_attention"]


class BlockMask(enum.Enum):
    """Which keys of a block a query sees."""

    FULL = "full"
    CAUSAL = "causal"  # query i sees keys 0..i (top-left aligned, as SDPA's is_causal)
    MASKED = "masked"  # none


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores, outputs and log-sum-exps are computed in: at least float32."""
    return torch.promote_types(dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: BlockMask, scale: float, first_row: int = 0) -> torch.Tensor:
    """Scaled scores (B, Hkv, G, Sq, Sk) in the accumulation dtype; masked entries -inf (causal:
    q's rows are the rows ``first_row``.. of the block, query i sees keys 0..first_row + i).

    Grouped-query attention: q's H = Hkv * G heads are viewed as (Hkv, G) and k is broadcast
    over G, so K/V are never expanded into a copy."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) are not a multiple of key/value heads ({k.shape[1]})")
    acc = accumulation_dtype(q.dtype)
    qg = (q.to(acc) * scale).unflatten(1, (k.shape[1], -1))
    s = qg @ k.to(acc).unsqueeze(2).transpose(-1, -2)
    if mask is BlockMask.CAUSAL:  # in place: the scores are the largest tensor of a block
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1 + first_row), float("-inf"))
    return s


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask = BlockMask.FULL,
                    scale: Optional[float] = None, first_row: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, H, Sq, D) over one block k, v (B, Hkv, Sk, D), H a multiple of Hkv.

    ``first_row`` (causal blocks): q holds the block's query rows ``first_row``.. (a tile of them).

    Returns (out (B, H, Sq, Dv), lse (B, H, Sq)), both in at least float32: ``lse`` is the
    log-sum-exp of each query's scaled scores over the block (-inf where it sees no key; its
    ``out`` is then 0). Differentiable. ``scale`` defaults to D ** -0.5.
    """
    # TODO(cuda): on CUDA the block's (out, lse) could come from torch's fused SDPA kernels
    # (aten._scaled_dot_product_efficient_attention with compute_log_sumexp=True); not done here
    # because no GPU was available to test it.
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bsz, heads, sq, _ = q.shape
    acc = accumulation_dtype(q.dtype)
    if mask is BlockMask.MASKED:
        return (q.new_zeros((bsz, heads, sq, v.shape[-1]), dtype=acc),
                q.new_full((bsz, heads, sq), float("-inf"), dtype=acc))
    s = _scores(q, k, mask, scale, first_row)
    lse = s.logsumexp(-1)
    shift = lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1)
    p = torch.exp(s - shift) if s.requires_grad else s.sub_(shift).exp_()  # in place unless differentiated
    out = p @ v.to(acc).unsqueeze(2)
    return out.flatten(1, 2), lse.flatten(1, 2)


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two key sets from each set's (out, lse): exact, differentiable
    where at least one lse is finite; a side with lse -inf (no key seen) contributes nothing."""
    lse = torch.logaddexp(lse_a, lse_b)
    ref = lse.masked_fill(lse == float("-inf"), 0).unsqueeze(-1)
    out = out_a * torch.exp(lse_a.unsqueeze(-1) - ref) + out_b * torch.exp(lse_b.unsqueeze(-1) - ref)
    return out, lse


def block_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                             lse: torch.Tensor, delta: torch.Tensor, mask: BlockMask, scale: float,
                             first_row: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block (flash attention's backward; not itself differentiable).

    ``dout``, ``lse`` and ``delta = sum(dout * out, -1)`` are the queries' over all blocks (final
    output and log-sum-exp), grouped as (B, Hkv, G, Sq[, Dv]) in the accumulation dtype; the
    results are in that dtype, dq (B, H, Sq, D), dk and dv summed over the query groups.
    """
    acc = dout.dtype
    p = _scores(q, k, mask, scale, first_row).sub_(lse.unsqueeze(-1)).exp_()  # in place: 2 score tensors at most
    vg = v.to(acc).unsqueeze(2)
    dv = (p.transpose(-1, -2) @ dout).sum(2)
    ds = (dout @ vg.transpose(-1, -2)).sub_(delta.unsqueeze(-1)).mul_(p)
    dq = (ds @ k.to(acc).unsqueeze(2)) * scale
    dk = (ds.transpose(-1, -2) @ q.to(acc).unflatten(1, (k.shape[1], -1))).sum(2) * scale
    return dq.flatten(1, 2), dk, dv
