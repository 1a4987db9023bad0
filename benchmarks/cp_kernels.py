"""Ring attention's block kernels on CPU: step time (forward + backward) with the plain torch ops
(materialised, tiled scores) vs torch's fused flash attention for CPU (the default there).

Ring attention alone (no model), ``--world`` gloo ranks, causal, head_tail layout: q (1, heads,
S/world, dim) and grouped-query K/V (kv_heads) per rank, float32, one thread per rank. Per
sequence length, ``--steps`` steps per kernel, the kernels alternating per round (the first
round unmeasured); median of the slowest rank's wall and process CPU time.

    python benchmarks/cp_kernels.py [--seqs 1024 2048 4096] [--world 2] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from hyper_parallel.parallel import ring_attention as ring
from hyper_parallel.parallel.block_attention import BlockKernel
from hyper_parallel.parallel.context import context_parallel
from hyper_parallel.parallel.ring_attention import cp_attention

from fsdp_step import _over_ranks
from launch import launch_benchmark

KERNELS: Dict[str, Optional[BlockKernel]] = {"plain": BlockKernel.PLAIN, "fused (default)": None}


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--world", type=int, default=2, help="ranks spawned without torchrun")
    p.add_argument("--steps", type=int, default=5, help="timed steps per (seq, kernel)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--device", default="cpu", choices=["cpu"])
    return p.parse_args(argv)


def _step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: Optional[BlockKernel]) -> None:
    ring._KERNEL = kernel
    try:
        with context_parallel(dist.group.WORLD) as cp:
            leaves = [cp.shard(t, dim=2).requires_grad_() for t in (q, k, v)]
            cp_attention(*leaves, is_causal=True).sum().backward()
    finally:
        ring._KERNEL = None


def run(args: argparse.Namespace) -> Dict[Tuple[int, str], dict]:
    torch.set_num_threads(1)
    results: Dict[Tuple[int, str], dict] = {}
    for seq in args.seqs:
        gen = torch.Generator().manual_seed(seq)
        q, k, v = (torch.randn(1, h, seq, args.dim, generator=gen) for h in (args.heads, args.kv_heads, args.kv_heads))
        for name in KERNELS:
            results[seq, name] = {"times": [], "cpu": []}
        for r in range(args.steps + 1):
            for name in (list(KERNELS) if r % 2 == 0 else list(KERNELS)[::-1]):
                dist.barrier()
                start, cpu_start = time.perf_counter(), time.process_time()
                _step(q, k, v, KERNELS[name])
                cpu, wall = _over_ranks(time.process_time() - cpu_start), _over_ranks(time.perf_counter() - start)
                if r:
                    results[seq, name]["times"].append(wall)
                    results[seq, name]["cpu"].append(cpu)
    return results


def _report(args: argparse.Namespace, results: Dict[Tuple[int, str], dict]) -> None:
    print(f"\nring attention, causal, {dist.get_world_size()} gloo ranks, heads {args.heads}/{args.kv_heads} "
          f"dim {args.dim}, float32, forward + backward, torch {torch.__version__}")
    print("| seq | kernel | step s (median) | CPU s/rank | vs plain (CPU) |")
    print("|---|---|---|---|---|")
    for seq in args.seqs:
        base = statistics.median(results[seq, "plain"]["cpu"])
        for name in KERNELS:
            res = results[seq, name]
            cpu = statistics.median(res["cpu"])
            print(f"| {seq} | {name} | {statistics.median(res['times']):.3f} | {cpu:.3f} | {cpu / base:.2f} |")


def main(argv: List[str] = None) -> None:
    args = _parse_args(argv)
    launch_benchmark(run, _report, args, args.world)


if __name__ == "__main__":
    main()
