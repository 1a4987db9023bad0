"""torch's fused attention kernels that return the log-sum-exp (the public SDPA returns only the
output) and their explicit backwards: what a ring attention block needs. Dropout is 0 throughout."""

from __future__ import annotations

from typing import Tuple

import torch


def cpu_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                        scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """aten's flash attention for CPU: (out (B, H, Sq, D), lse (B, H, Sq)); k, v may have fewer
    heads (H a multiple of theirs), any strides; causal is top-left aligned."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)


def cpu_flash_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                                 scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`cpu_flash_attention` given the final ``out`` and ``lse``."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, is_causal, scale=scale)


def cuda_efficient_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                             scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """aten's memory-efficient attention (CUDA; equal head counts): (out, lse (B, H, Sq padded
    to a multiple of 32, float32))."""
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, is_causal,
                                                                           scale=scale)
    return out, lse


def cuda_efficient_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                      out: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                                      scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`cuda_efficient_attention` given the final ``out`` and its padded ``lse``
    (no dropout: the random-number state is unused, CPU scalars as its forward returns them)."""
    seed = torch.zeros((), dtype=torch.long)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, seed, 0.0, [True, True, True, False], is_causal, scale=scale)
    return dq, dk, dv


def cuda_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                         scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """aten's flash attention (CUDA, float16/bfloat16, sm80+): (out (B, H, Sq, D) laid out as
    (B, Sq, H, D), lse (B, H, Sq) float32); k, v may have fewer heads (H a multiple of theirs)."""
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
    return out, lse


def cuda_flash_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  out: torch.Tensor, lse: torch.Tensor, is_causal: bool,
                                  scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of :func:`cuda_flash_attention` given the final ``out`` (q's dtype) and its
    contiguous float32 ``lse``; dk, dv have k's heads. Dense inputs (no cumulative sequence
    lengths); no dropout, so the random-number state is not read."""
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, is_causal, seed, offset, scale=scale)
    return dq, dk, dv


def cuda_flash_attention_applies(device: torch.device) -> bool:
    """Whether torch's CUDA flash attention kernel runs on ``device``: built in, enabled
    (``torch.backends.cuda.flash_sdp_enabled``) and an sm80 or newer GPU."""
    return (device.type == "cuda" and torch.backends.cuda.is_flash_attention_available()
            and torch.backends.cuda.flash_sdp_enabled() and torch.cuda.get_device_capability(device) >= (8, 0))
