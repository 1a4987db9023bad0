"""Context parallelism's kernels checked on one device: what the CPU suite can only check
through fakes (tests/test_block_attention_kernels.py) run on the real kernels.

1. Each fused block kernel against the plain torch ops (computed in float32 from the same
   inputs) in bfloat16, float16 and float32: output, log-sum-exp, dq, dk, dv, full and causal,
   grouped-query. On CUDA: flash attention (float16/bfloat16, where it runs) and the
   memory-efficient kernel (every dtype), each handed ``out`` as the caller has it, in the
   (B, H, S, D)-contiguous layout, and in the layout the ring keeps; on CPU: CPU flash attention.
2. Ring attention on a one-rank process group (NCCL on CUDA, gloo on CPU) against SDPA:
   output and q/k/v gradients, with the default kernel and each fused kernel forced.

Relative errors (norm of the difference / norm of the reference) are printed per case; the
exit status is 1 if one exceeds its dtype's bound (the rounding of the inputs' dtype; a wrong
layout or mask is 0.1 or more).

    python benchmarks/cp_gpu_checks.py --device cuda     # what benchmarks/gpu_session.sh runs
    python benchmarks/cp_gpu_checks.py --device cpu      # the same checks on CPU (smaller)
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyper_parallel.parallel import ring_attention as ring
from hyper_parallel.parallel.block_attention import (BlockKernel, BlockMask, block_attention, block_attention_backward,
                                                     block_kernel, kernel_layout)
from hyper_parallel.parallel.context import context_parallel
from hyper_parallel.parallel.ring_attention import cp_attention
from hyper_parallel.platform import free_port

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BOUND = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-3}
SCALE = 0.088


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _fused_kernels(device: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> List[BlockKernel]:
    """The fused kernels to check for these inputs: block_kernel's choice, and on CUDA the
    memory-efficient kernel too where flash attention is the choice."""
    chosen = block_kernel(q, k, v)
    kernels = [chosen] if chosen is not BlockKernel.PLAIN else []
    if device == "cuda" and chosen is BlockKernel.CUDA_FLASH:
        kernels.append(BlockKernel.CUDA_EFFICIENT)
    return kernels


def check_blocks(device: str, seq: int, dim: int) -> List[Tuple[str, float, float]]:
    """(case, worst relative error, bound) of each fused block kernel against the plain ops."""
    results = []
    for dtype in DTYPES:
        for heads, kv_heads, s, mask in ((8, 8, seq, BlockMask.CAUSAL), (8, 2, seq - 24, BlockMask.CAUSAL),
                                         (8, 2, seq, BlockMask.FULL)):
            gen = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(2, heads, s, dim, device=device, dtype=dtype, generator=gen)
            k, v = (torch.randn(2, kv_heads, s, dim, device=device, dtype=dtype, generator=gen) for _ in range(2))
            dout = torch.randn(2, heads, s, dim, device=device, generator=gen)
            with torch.no_grad():
                ref_out, ref_lse = block_attention(q, k, v, mask, SCALE, 0, BlockKernel.PLAIN)
                ref = (ref_out, ref_lse) + block_attention_backward(q, k, v, dout, ref_out, ref_lse, mask, SCALE, 0,
                                                                    BlockKernel.PLAIN)
                for kernel in _fused_kernels(device, q, k, v):
                    out, lse = block_attention(q, k, v, mask, SCALE, 0, kernel)
                    for layout, given in (("contiguous out", out.contiguous()), ("ring's out", kernel_layout(out))):
                        grads = block_attention_backward(q, k, v, dout, given, lse, mask, SCALE, 0, kernel)
                        errors = {n: _rel(a, b) for n, a, b in zip(("out", "lse", "dq", "dk", "dv"),
                                                                   (out, lse) + grads, ref)}
                        case = (f"block {kernel.value} {str(dtype)[6:]} H{heads}/{kv_heads} S{s} {mask.value} "
                                f"({layout}): " + " ".join(f"{n} {e:.1e}" for n, e in errors.items()))
                        results.append((case, max(errors.values()), BOUND[dtype]))
    return results


def check_ring(device: str, seq: int, dim: int) -> List[Tuple[str, float, float]]:
    """(case, worst relative error, bound) of ring attention on a one-rank group against SDPA
    (computed in float32 from the same inputs), causal and not, default and forced kernels."""
    results = []
    kernels: List[Optional[BlockKernel]] = [None]
    kernels += [BlockKernel.CUDA_FLASH, BlockKernel.CUDA_EFFICIENT] if device == "cuda" else [BlockKernel.CPU_FLASH]
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator(device=device).manual_seed(1)
        q, k, v = (torch.randn(1, h, seq, dim, device=device, dtype=dtype, generator=gen) for h in (8, 2, 2))
        dout = torch.randn(1, 8, seq, dim, device=device, dtype=dtype, generator=gen)
        for causal in (True, False):
            leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
            expected = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True)
            expected.backward(dout.float())
            reference = [expected.detach()] + [t.grad for t in leaves]
            for kernel in kernels:
                if kernel is BlockKernel.CUDA_FLASH and dtype not in (torch.float16, torch.bfloat16):
                    continue
                ring._KERNEL = kernel
                try:
                    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
                    with context_parallel(dist.group.WORLD):
                        out = cp_attention(*leaves, is_causal=causal)
                        out.backward(dout)
                finally:
                    ring._KERNEL = None
                errors = {n: _rel(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"),
                                                           [out.detach()] + [t.grad for t in leaves], reference)}
                name = "default" if kernel is None else kernel.value
                case = (f"ring {name} {str(dtype)[6:]} H8/2 S{seq} causal={causal}: "
                        + " ".join(f"{n} {e:.1e}" for n, e in errors.items()))
                results.append((case, max(errors.values()), BOUND[dtype]))
    return results


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: 1024 cuda, 64 cpu)")
    parser.add_argument("--dim", type=int, default=None, help="head size (default: 128 cuda, 32 cpu)")
    args = parser.parse_args(argv)
    seq = args.seq or (1024 if args.device == "cuda" else 64)
    dim = args.dim or (128 if args.device == "cuda" else 32)
    print(f"torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""), flush=True)
    results = check_blocks(args.device, seq, dim)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if args.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    try:
        results += check_ring(args.device, seq, dim)
    finally:
        dist.destroy_process_group()
    failed: Dict[str, float] = {}
    for case, worst, bound in results:
        print(("FAIL " if worst > bound else "ok   ") + case, flush=True)
        if worst > bound:
            failed[case] = worst
    print(f"{len(results) - len(failed)} of {len(results)} checks within their dtype's bound")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
