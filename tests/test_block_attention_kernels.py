"""The fused block kernels against the plain torch ops, and which kernel the dispatch picks.

Float64 (the CPU flash kernel runs in it): the two paths sum in another order, ~1e-16 relative
noise; a wrong mask, scale, group or log-sum-exp is 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch

from hyper_parallel import _torch_compat as compat
from hyper_parallel.block_attention import (BlockKernel, BlockMask, _fused_backward, _fused_forward,
                                            block_attention, block_attention_backward, block_kernel)

TOL = 1e-12


def _inputs(heads, kv_heads, sq, sk, dtype=torch.float64, seed=0, dim=8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, sq, dim, generator=gen, dtype=dtype)
    k = torch.randn(2, kv_heads, sk, dim, generator=gen, dtype=dtype)
    v = torch.randn(2, kv_heads, sk, dim, generator=gen, dtype=dtype)
    return q, k, v, torch.randn(2, heads, sq, dim, generator=gen, dtype=torch.promote_types(dtype, torch.float32))


class _Counted:
    """Counts the calls of a ``_torch_compat`` function (restored on exit)."""

    def __init__(self, monkeypatch, name):
        self.calls, real = 0, getattr(compat, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(compat, name, counted)


def _both_paths(q, k, v, dout, mask, kernel):
    """(out, lse, dq, dk, dv) of one block by ``kernel``; the backward with the block's own out/lse."""
    scale = 0.3
    out, lse = block_attention(q, k, v, mask, scale, 0, kernel)
    grads = block_attention_backward(q, k, v, dout, out, lse, mask, scale, 0, kernel)
    return (out, lse) + tuple(grads)


@pytest.mark.parametrize("mask", [BlockMask.FULL, BlockMask.CAUSAL])
@pytest.mark.parametrize("heads,kv_heads,sq,sk", [(4, 4, 16, 16), (4, 2, 16, 16), (6, 2, 7, 7), (4, 1, 5, 24),
                                                  (2, 2, 40, 3)])
def test_cpu_flash_kernel_equals_plain_ops(monkeypatch, mask, heads, kv_heads, sq, sk):
    if mask is BlockMask.CAUSAL and sq != sk:  # a causal block is square (else the plain ops compute it)
        sk = sq
    q, k, v, dout = _inputs(heads, kv_heads, sq, sk)
    forward = _Counted(monkeypatch, "cpu_flash_attention")
    backward = _Counted(monkeypatch, "cpu_flash_attention_backward")
    fused = _both_paths(q, k, v, dout, mask, None)  # block_kernel's choice
    assert (forward.calls, backward.calls) == (1, 1)
    plain = _both_paths(q, k, v, dout, mask, BlockKernel.PLAIN)
    assert (forward.calls, backward.calls) == (1, 1)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), fused, plain):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert (a - b).abs().max() < TOL, name
    assert plain[3].abs().max() > 1e-2  # the comparison is not vacuous


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
def test_cpu_flash_kernel_runs_in_the_accumulation_dtype(dtype, tol):
    q, k, v, dout = _inputs(4, 2, 12, 12, dtype=dtype)
    fused = _both_paths(q, k, v, dout, BlockMask.CAUSAL, BlockKernel.CPU_FLASH)
    plain = _both_paths(q, k, v, dout, BlockMask.CAUSAL, BlockKernel.PLAIN)
    for a, b in zip(fused, plain):
        assert a.dtype == torch.float32 and (a - b).abs().max() < tol


def test_block_kernel_choice():
    q, k, v, _ = _inputs(4, 2, 8, 8)
    assert block_kernel(q, k, v) is BlockKernel.CPU_FLASH
    assert block_kernel(q.requires_grad_(), k, v) is BlockKernel.PLAIN  # a fused lse has no gradient
    with torch.no_grad():
        assert block_kernel(q, k, v) is BlockKernel.CPU_FLASH
    q = q.detach()
    assert block_kernel(q, k, torch.zeros(2, 2, 8, 4, dtype=q.dtype)) is BlockKernel.PLAIN  # head sizes differ
    assert block_kernel(q, k.float(), v) is BlockKernel.PLAIN
    meta = [t.to("meta") for t in (q, k, v)]
    assert block_kernel(*meta) is BlockKernel.PLAIN


def test_blocks_a_fused_kernel_cannot_express_use_the_plain_ops(monkeypatch):
    """A causal tile (rows from the middle of the block), a non-square causal block, no keys."""
    forward = _Counted(monkeypatch, "cpu_flash_attention")
    q, k, v, _ = _inputs(4, 2, 12, 12)
    tile = block_attention(q[:, :, 6:], k, v, BlockMask.CAUSAL, None, 6)
    ref = block_attention(q, k, v, BlockMask.CAUSAL)
    assert (tile[0] - ref[0][:, :, 6:]).abs().max() < TOL and forward.calls == 1
    block_attention(q[:, :, :6], k, v, BlockMask.CAUSAL)
    out, lse = block_attention(q, k[:, :, :0], v[:, :, :0])  # (the CPU kernel crashes on no keys)
    assert forward.calls == 1 and out.abs().max() == 0 and bool((lse == float("-inf")).all())
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]  # a forced fused kernel: autograd still exact
    block_attention(*leaves, BlockMask.FULL, None, 0, BlockKernel.CPU_FLASH)[1].sum().backward()
    assert forward.calls == 1 and leaves[0].grad.abs().max() > 0
    with pytest.raises(ValueError, match=r"query heads \(4\) are not a multiple of key/value heads \(3\)"):
        block_attention(q, k.repeat(1, 2, 1, 1)[:, :3], v[:, :1].repeat(1, 3, 1, 1))


@pytest.mark.parametrize("causal", [False, True])
def test_cuda_efficient_kernel_shapes_on_meta_tensors(causal):
    """The CUDA path's plumbing (head repetition for GQA, the lse's padded rows, the groups' sum
    of dk and dv) on meta tensors; its numbers need a GPU, which these tests do not have."""
    q, k, v = (torch.empty(2, heads, 40, 8, device="meta", dtype=torch.bfloat16) for heads in (6, 2, 2))
    out, lse = _fused_forward(BlockKernel.CUDA_EFFICIENT, q, k, v, causal, 0.3)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((2, 6, 40, 8), torch.float32, (2, 6, 40), torch.float32)
    dq, dk, dv = _fused_backward(BlockKernel.CUDA_EFFICIENT, q, k, v, out, out, lse, causal, 0.3)
    assert [t.shape for t in (dq, dk, dv)] == [q.shape, k.shape, v.shape]
    assert {t.dtype for t in (dq, dk, dv)} == {torch.float32}
