"""Attention over one block of keys/values, returning its log-sum-exp, and the exact merge of
such partial results: the pieces ring attention (:mod:`hyper_parallel.parallel.ring_attention`)
is made of.

A block is computed by one of the :class:`BlockKernel` s, chosen in one place, :func:`block_kernel`:
torch's fused attention kernels that return the log-sum-exp where they apply (CPU: flash attention
for CPU; CUDA: flash attention for float16/bfloat16 on sm80+, else memory-efficient attention),
else plain torch ops (any device, any dtype, at least float32 inside; the scores are
materialised, so callers tile the queries). Grouped-query attention: the plain ops and both
flash kernels take K/V with their own heads (broadcast, never expanded); the CUDA
memory-efficient kernel needs equal head counts, so K/V are repeated for its call only.

The CUDA kernels write ``out`` (B, H, S, D) laid out as (B, S, H, D) and their backwards read it
so (the memory-efficient one with a fixed row stride of H x D): :func:`kernel_layout` is that
layout, the one the ring's output accumulator keeps.
"""

from __future__ import annotations

import enum
from typing import Optional, Tuple

import torch

from hyper_parallel import _torch_compat as compat

__all__ = ["BlockKernel", "BlockMask", "accumulation_dtype", "block_attention", "block_attention_backward",
           "block_kernel", "kernel_layout", "merge_attention", "new_kernel_layout"]


class BlockMask(enum.Enum):
    """Which keys of a block a query sees."""

    FULL = "full"
    CAUSAL = "causal"  # query i sees keys 0..i (top-left aligned, as SDPA's is_causal)
    MASKED = "masked"  # none


class BlockKernel(enum.Enum):
    """What computes a block's attention (see :func:`block_kernel`)."""

    PLAIN = "plain"  # torch ops, the scores materialised: any device and dtype; differentiable
    CPU_FLASH = "cpu_flash"  # aten's flash attention for CPU, run in the accumulation dtype
    CUDA_FLASH = "cuda_flash"  # aten's flash attention (float16, bfloat16; sm80+; head size <= 256)
    CUDA_EFFICIENT = "cuda_efficient"  # aten's memory-efficient attention (float16, bfloat16, float32)


_CUDA_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_CUDA_EFFICIENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CUDA_FLASH_MAX_HEAD = 256


def block_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> BlockKernel:
    """The kernel for blocks of q over k, v: a fused one where torch has one for their device and
    dtype (CPU: any float dtype; CUDA: flash attention for float16/bfloat16 with a head size
    of at most 256 on a GPU it runs on, else memory-efficient attention for
    float16/bfloat16/float32; CUDA head sizes a multiple of 8), the head sizes are equal and
    no input is being differentiated (a fused kernel's log-sum-exp has no gradient: callers
    differentiate through :func:`block_attention_backward`); else PLAIN."""
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]) or not (q.dtype == k.dtype == v.dtype):
        return BlockKernel.PLAIN
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return BlockKernel.PLAIN
    if q.device.type == "cpu" and q.dtype.is_floating_point:
        return BlockKernel.CPU_FLASH
    if q.device.type == "cuda" and q.shape[-1] % 8 == 0:
        if (q.dtype in _CUDA_FLASH_DTYPES and q.shape[-1] <= _CUDA_FLASH_MAX_HEAD
                and compat.cuda_flash_attention_applies(q.device)):
            return BlockKernel.CUDA_FLASH
        if q.dtype in _CUDA_EFFICIENT_DTYPES:
            return BlockKernel.CUDA_EFFICIENT
    return BlockKernel.PLAIN


def kernel_layout(t: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``t`` (B, H, S, D) in ``dtype`` (default its own) with the memory layout the CUDA kernels
    write and read: strides (any, D, H x D, 1), i.e. a (B, S, H, D) tensor transposed. ``t``
    itself when it already is (a row slice of such a tensor is), else a copy."""
    dtype = t.dtype if dtype is None else dtype
    heads, dim = t.shape[1], t.shape[3]
    if t.dtype == dtype and t.stride()[1:] == (dim, heads * dim, 1):
        return t
    return new_kernel_layout(t.shape, t, dtype).copy_(t)


def new_kernel_layout(shape: Tuple[int, int, int, int], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised (B, H, S, D) ``shape`` in :func:`kernel_layout`, on ``like``'s device."""
    bsz, heads, seq, dim = shape
    return like.new_empty((bsz, seq, heads, dim), dtype=dtype).transpose(1, 2)


def _fused(kernel: Optional[BlockKernel], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask,
           first_row: int) -> Optional[BlockKernel]:
    """The fused kernel that computes this block, or None: ``kernel`` (None: :func:`block_kernel`'s
    choice) if fused, no input is being differentiated (so a forced kernel never breaks autograd),
    and the block is non-empty and FULL or CAUSAL from its first row on a square block (the
    kernels' causal mask is top-left aligned, flash attention's on CUDA bottom-right: the same
    on a square block; they take no row offset)."""
    kernel = block_kernel(q, k, v) if kernel is None else kernel
    if kernel is BlockKernel.PLAIN or not (q.shape[2] and k.shape[2]):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return None
    if mask is BlockMask.FULL or (mask is BlockMask.CAUSAL and first_row == 0 and q.shape[2] == k.shape[2]):
        return kernel
    return None


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``t`` (B, Hkv, S, D) with each head repeated for its query group: a copy (G x ``t``)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], 1)


_EFFICIENT_LSE_ROWS = 32  # the memory-efficient kernel's lse rows are padded to a multiple of this


def _fused_forward(kernel: BlockKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    acc = accumulation_dtype(q.dtype)
    if kernel is BlockKernel.CPU_FLASH:  # GQA as is; the casts are no-ops in float32/float64
        return compat.cpu_flash_attention(q.to(acc), k.to(acc), v.to(acc), causal, scale)
    if kernel is BlockKernel.CUDA_FLASH:  # GQA as is
        out, lse = compat.cuda_flash_attention(q, k, v, causal, scale)
        return out.to(acc), lse.to(acc)
    heads = q.shape[1]
    out, lse = compat.cuda_efficient_attention(q, _repeat_heads(k, heads), _repeat_heads(v, heads), causal, scale)
    return out.to(acc), lse[..., :q.shape[2]].to(acc)


def _fused_backward(kernel: BlockKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, causal: bool,
                    scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    acc = accumulation_dtype(q.dtype)
    if kernel is BlockKernel.CPU_FLASH:
        return compat.cpu_flash_attention_backward(dout.to(acc), q.to(acc), k.to(acc), v.to(acc), out.to(acc),
                                                   lse.to(acc), causal, scale)
    out = kernel_layout(out, q.dtype)  # what the forward wrote: the layout the backwards read
    if kernel is BlockKernel.CUDA_FLASH:  # GQA as is: dk, dv come with k's heads
        grads = compat.cuda_flash_attention_backward(
            dout.to(q.dtype), q, k, v, out, lse.to(torch.float32).contiguous(), causal, scale)
        return tuple(g.to(acc) for g in grads)  # type: ignore[return-value]
    (bsz, heads, sq, _), kv_heads = q.shape, k.shape[1]
    padded = lse.new_zeros((bsz, heads, -(-sq // _EFFICIENT_LSE_ROWS) * _EFFICIENT_LSE_ROWS), dtype=torch.float32)
    padded[..., :sq] = lse
    dq, dk, dv = compat.cuda_efficient_attention_backward(
        dout.to(q.dtype), q, _repeat_heads(k, heads), _repeat_heads(v, heads), out, padded, causal, scale)
    per_kv = lambda t: t.unflatten(1, (kv_heads, -1)).sum(2).to(acc)  # noqa: E731 - the group's sum
    return dq.to(acc), per_kv(dk), per_kv(dv)


def _check_heads(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) are not a multiple of key/value heads ({k.shape[1]})")


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores, outputs and log-sum-exps are computed in: at least float32."""
    return torch.promote_types(dtype, torch.float32)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: BlockMask, scale: float, first_row: int = 0,
            allowed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scaled scores (B, Hkv, G, Sq, Sk) in the accumulation dtype; masked entries -inf (causal:
    q's rows are the rows ``first_row``.. of the block, query i sees keys 0..first_row + i;
    ``allowed`` (B, Sq, Sk): also the pairs it marks False, e.g. of different documents).

    Grouped-query attention: q's H = Hkv * G heads are viewed as (Hkv, G) and k is broadcast
    over G, so K/V are never expanded into a copy."""
    acc = accumulation_dtype(q.dtype)
    qg = (q.to(acc) * scale).unflatten(1, (k.shape[1], -1))
    s = qg @ k.to(acc).unsqueeze(2).transpose(-1, -2)
    if mask is BlockMask.CAUSAL:  # in place: the scores are the largest tensor of a block
        s.masked_fill_(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1 + first_row), float("-inf"))
    if allowed is not None:
        s.masked_fill_(~allowed[:, None, None], float("-inf"))
    return s


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask = BlockMask.FULL,
                    scale: Optional[float] = None, first_row: int = 0, kernel: Optional[BlockKernel] = None,
                    allowed: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of q (B, H, Sq, D) over one block k, v (B, Hkv, Sk, D), H a multiple of Hkv.

    ``first_row`` (causal blocks): q holds the block's query rows ``first_row``.. (a tile of them).
    ``allowed`` (B, Sq, Sk) bool: only the (query, key) pairs it marks may attend besides
    ``mask`` (document masks); computed by the plain ops.

    Returns (out (B, H, Sq, Dv), lse (B, H, Sq)), both in at least float32: ``lse`` is the
    log-sum-exp of each query's scaled scores over the block (-inf where it sees no key; its
    ``out`` is then 0). ``scale`` defaults to D ** -0.5. ``kernel`` (default
    :func:`block_kernel`'s choice) computes it where it can express the block, else the plain
    ops do; the result is differentiable when the plain ops compute it.
    """
    _check_heads(q, k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bsz, heads, sq, _ = q.shape
    acc = accumulation_dtype(q.dtype)
    if mask is BlockMask.MASKED:
        return (q.new_zeros((bsz, heads, sq, v.shape[-1]), dtype=acc),
                q.new_full((bsz, heads, sq), float("-inf"), dtype=acc))
    fused = None if allowed is not None else _fused(kernel, q, k, v, mask, first_row)
    if fused is not None:
        return _fused_forward(fused, q, k, v, mask is BlockMask.CAUSAL, scale)
    s = _scores(q, k, mask, scale, first_row, allowed)
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
                             out: torch.Tensor, lse: torch.Tensor, mask: BlockMask, scale: float,
                             first_row: int = 0, kernel: Optional[BlockKernel] = None,
                             allowed: Optional[torch.Tensor] = None
                             ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block (flash attention's backward; not itself differentiable).

    ``dout``, ``out`` (B, H, Sq, Dv) and ``lse`` (B, H, Sq) are the queries' over all blocks
    (gradient of the final output, final output and log-sum-exp), ``dout`` and ``out`` in q's
    dtype or the accumulation dtype (any layout; :func:`kernel_layout` saves the CUDA kernels a
    copy), ``lse`` in the accumulation dtype. The results are in that dtype, dq (B, H, Sq, D), dk
    and dv (B, Hkv, Sk, D) summed over the query groups. ``kernel`` and ``allowed`` as in
    :func:`block_attention`.
    """
    _check_heads(q, k)
    fused = None if allowed is not None else _fused(kernel, q, k, v, mask, first_row)
    if fused is not None:
        return _fused_backward(fused, q, k, v, dout, out, lse, mask is BlockMask.CAUSAL, scale)
    acc = accumulation_dtype(q.dtype)
    dout, out, lse = dout.to(acc), out.to(acc), lse.to(acc)
    grouped = lambda t: t.unflatten(1, (k.shape[1], -1))  # noqa: E731 - (B, Hkv, G, ...)
    delta = grouped((dout * out).sum(-1))
    dout, lse = grouped(dout), grouped(lse)
    p = _scores(q, k, mask, scale, first_row, allowed).sub_(lse.unsqueeze(-1)).exp_()  # in place: 2 score tensors at most
    vg = v.to(acc).unsqueeze(2)
    dv = (p.transpose(-1, -2) @ dout).sum(2)
    ds = (dout @ vg.transpose(-1, -2)).sub_(delta.unsqueeze(-1)).mul_(p)
    dq = (ds @ k.to(acc).unsqueeze(2)) * scale
    dk = (ds.transpose(-1, -2) @ q.to(acc).unflatten(1, (k.shape[1], -1))).sum(2) * scale
    return dq.flatten(1, 2), dk, dv
