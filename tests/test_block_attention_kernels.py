"""The fused block kernels against the plain torch ops, and which kernel the dispatch picks.

Float64 (the CPU flash kernel runs in it): the two paths sum in another order, ~1e-16 relative
noise; a wrong mask, scale, group or log-sum-exp is 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch

from hyper_parallel import _torch_compat as compat
from hyper_parallel.parallel.block_attention import (BlockKernel, BlockMask, _fused_backward, _fused_forward,
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


@pytest.mark.parametrize("kernel", [BlockKernel.CUDA_FLASH, BlockKernel.CUDA_EFFICIENT])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_kernel_shapes_on_meta_tensors(kernel, causal):
    """The CUDA paths' plumbing through the real aten ops (GQA as is for flash attention, head
    repetition and the lse's padded rows for memory-efficient attention, the groups' sum of dk
    and dv) on meta tensors; their numbers need a GPU, which these tests do not have."""
    q, k, v = (torch.empty(2, heads, 40, 8, device="meta", dtype=torch.bfloat16) for heads in (6, 2, 2))
    out, lse = _fused_forward(kernel, q, k, v, causal, 0.3)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((2, 6, 40, 8), torch.float32, (2, 6, 40), torch.float32)
    dq, dk, dv = _fused_backward(kernel, q, k, v, out, out, lse, causal, 0.3)
    assert [t.shape for t in (dq, dk, dv)] == [q.shape, k.shape, v.shape]
    assert {t.dtype for t in (dq, dk, dv)} == {torch.float32}


# --------------------------------------------------------------------------- the CUDA kernels' contracts


def _kernel_strides(t):
    """Whether ``t`` (B, H, S, D) is laid out as the CUDA kernels write it: (B, S, H, D) transposed."""
    return t.stride()[1:] == (t.shape[3], t.shape[1] * t.shape[3], 1)


class FakeCudaKernels:
    """Stand-ins for the four CUDA kernels in ``_torch_compat`` that compute on CPU (the CPU flash
    kernel, in the inputs' dtype) under the CUDA kernels' contracts, and record what they were
    handed. They write ``out`` as the CUDA forwards do ((B, S, H, D) transposed) and read it as the
    backwards do: the memory-efficient one at row stride H x D whatever ``out``'s strides are
    (a (B, H, S, D)-contiguous ``out`` is then read from the wrong rows, as on a GPU), flash
    attention through a copy. Their log-sum-exps are float32, as the kernels'; the
    memory-efficient one's rows padded to a multiple of 32. Use as a context manager."""

    NAMES = ("cuda_flash_attention", "cuda_flash_attention_backward", "cuda_efficient_attention",
             "cuda_efficient_attention_backward")

    def __init__(self):
        self.calls = []  # (kernel name, facts about its arguments)

    def __enter__(self):
        self._real = {name: getattr(compat, name) for name in self.NAMES}
        for name in self.NAMES:
            setattr(compat, name, getattr(self, name))
        return self

    def __exit__(self, *exc):
        for name, fn in self._real.items():
            setattr(compat, name, fn)

    @staticmethod
    def _as_written(out):
        return out.transpose(1, 2).contiguous().transpose(1, 2)

    def cuda_flash_attention(self, q, k, v, causal, scale):
        self.calls.append(("flash", {"kv_heads": k.shape[1], "dtypes": {t.dtype for t in (q, k, v)}}))
        out, lse = compat.cpu_flash_attention(q, k, v, causal, scale)
        return self._as_written(out), lse.float()

    def cuda_flash_attention_backward(self, dout, q, k, v, out, lse, causal, scale):
        self.calls.append(("flash_backward", {"kv_heads": k.shape[1], "lse": (lse.dtype, lse.is_contiguous()),
                                              "dtypes": {t.dtype for t in (dout, q, k, v, out)},
                                              "out_strides_ok": _kernel_strides(out)}))
        return compat.cpu_flash_attention_backward(dout, q, k, v, out.contiguous(), lse.to(q.dtype), causal, scale)

    def cuda_efficient_attention(self, q, k, v, causal, scale):
        assert k.shape[1] == v.shape[1] == q.shape[1], "the memory-efficient kernel needs equal head counts"
        self.calls.append(("efficient", {"kv_heads": k.shape[1], "dtypes": {t.dtype for t in (q, k, v)}}))
        out, lse = compat.cpu_flash_attention(q, k, v, causal, scale)
        padded = lse.new_zeros(lse.shape[:2] + (-(-lse.shape[2] // 32) * 32,), dtype=torch.float32)
        padded[..., :lse.shape[2]] = lse
        return self._as_written(out), padded

    def cuda_efficient_attention_backward(self, dout, q, k, v, out, lse, causal, scale):
        (bsz, heads, sq, dim), stride = out.shape, out.stride()
        self.calls.append(("efficient_backward", {"kv_heads": k.shape[1], "lse": (lse.dtype, lse.is_contiguous()),
                                                  "lse_rows": lse.shape[2], "dtypes": {t.dtype for t in (dout, q, k, v, out)},
                                                  "out_strides_ok": _kernel_strides(out)}))
        # the kernel's read: batch and head strides from the tensor, rows H x D apart (past the
        # end of the storage for a (B, H, S, D)-contiguous out: refused as out of bounds here)
        read = out.as_strided(out.shape, (stride[0], stride[1], heads * dim, 1))
        return compat.cpu_flash_attention_backward(dout, q, k, v, read, lse[..., :sq].to(q.dtype), causal, scale)


CUDA_KERNELS = (BlockKernel.CUDA_FLASH, BlockKernel.CUDA_EFFICIENT)
FAKE_KERNEL_TOL = 1e-5  # float32 log-sum-exps (the kernels'); a misread out is 1e-1 or more


@pytest.mark.parametrize("kernel", CUDA_KERNELS)
@pytest.mark.parametrize("mask", [BlockMask.FULL, BlockMask.CAUSAL])
def test_cuda_kernels_are_handed_what_they_read(kernel, mask):
    """Each CUDA kernel gets ``out`` in the layout it reads, its log-sum-exp as it reads it and
    the dtypes it takes, whatever layout the caller's ``out`` has; flash attention takes the
    K/V heads as they are. Checked through fakes under the kernels' contracts (no GPU here)."""
    q, k, v, dout = _inputs(4, 2, 24, 24)
    plain = _both_paths(q, k, v, dout, mask, BlockKernel.PLAIN)
    with FakeCudaKernels() as fake:
        out, lse = block_attention(q, k, v, mask, 0.3, 0, kernel)
        assert _kernel_strides(out)  # as the kernel wrote it
        caller_out = out.contiguous()  # (B, H, S, D)-contiguous: not what the kernels read
        assert not _kernel_strides(caller_out)
        grads = block_attention_backward(q, k, v, dout, caller_out, lse, mask, 0.3, 0, kernel)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + tuple(grads), plain):
        assert a.shape == b.shape and (a - b).abs().max() < FAKE_KERNEL_TOL, name
    (_, forward), (_, backward) = fake.calls
    assert backward["out_strides_ok"] and backward["lse"] == (torch.float32, True)
    assert backward["dtypes"] == forward["dtypes"] == {q.dtype}
    assert forward["kv_heads"] == backward["kv_heads"] == (2 if kernel is BlockKernel.CUDA_FLASH else 4)
    if kernel is BlockKernel.CUDA_EFFICIENT:
        assert backward["lse_rows"] == 32
