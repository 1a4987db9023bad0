"""One MoE layer's training step at a shape where the experts matter (default 64 and 128
experts, top-8), in one process, three comparisons (times are medians over alternating steps,
process CPU time on CPU, wall time on CUDA):

1. ``vs torchtitan``: our ``MoE`` against torchtitan 0.3.0's MoE layer (same weights, softmax
   routing, renormalised top-k, no shared expert), each wrapped in torch's ``fully_shard``
   (one rank, bf16 parameters, fp32 reduce: torchtitan's experts compute in bf16 whatever the
   parameters), forward + backward + AdamW. Skipped when torchtitan is not installed.
2. ``vs plain``: our ``MoE`` alone against a plain grouped-GEMM layer written out below (route,
   sort, three grouped GEMMs, unsort; no statistics, no checks), forward + backward.
3. ``grouped vs split``: our experts' grouped GEMM against the split fallback
   (``ExpertMatmul.SPLIT``), forward + backward.

It also counts the host reads (device-to-host syncs on an accelerator) of one step of our
layer: on CUDA under ``torch.cuda.set_sync_debug_mode("warn")`` (the warnings torch emits), on
CPU with :func:`hyper_parallel.utils.host_reads.counted_host_reads`.

    python benchmarks/moe_layer.py [--experts 64 128] [--tokens 1024] [--steps 10] [--device cpu]
        [--skip-torchtitan] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
import warnings
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hyper_parallel._torch_compat import grouped_mm
from hyper_parallel.models.moe_layer import ExpertMatmul, MoE
from hyper_parallel.utils.host_reads import counted_host_reads


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=128, help="each expert's SwiGLU hidden size")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per implementation")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (cpu only)")
    parser.add_argument("--skip-torchtitan", action="store_true")
    parser.add_argument("--only", choices=("torchtitan", "plain", "split", "syncs"), nargs="+",
                        default=["torchtitan", "plain", "split", "syncs"])
    parser.add_argument("--json", help="also write the results to this file")
    return parser.parse_args(argv)


class PlainGroupedMoE(nn.Module):
    """The baseline: a MoE layer as plain as grouped GEMM allows (same parameters as ``MoE``)."""

    def __init__(self, ours: MoE):
        super().__init__()
        self.top_k = ours.top_k
        self.gate = copy.deepcopy(ours.router.gate)
        self.w1, self.w2, self.w3 = (copy.deepcopy(p) for p in (ours.experts.w1, ours.experts.w2, ours.experts.w3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        pairs = experts.flatten()
        order = torch.argsort(pairs, stable=True)
        counts = torch.zeros(self.w1.shape[0], dtype=torch.int64, device=x.device).scatter_add_(
            0, pairs, torch.ones_like(pairs))
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = x[order // self.top_k]
        h = F.silu(grouped_mm(rows, self.w1.transpose(-2, -1), offs=offsets))
        h = h * grouped_mm(rows, self.w3.transpose(-2, -1), offs=offsets)
        out = grouped_mm(h, self.w2.transpose(-2, -1), offs=offsets) * weights.flatten()[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, order // self.top_k, out.type_as(x)).view(shape)


def _torchtitan_moe(ours: MoE) -> nn.Module:
    """torchtitan 0.3.0's MoE layer with ``ours``'s weights (and routing: softmax, top-k renormalised)."""
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import MoE as TitanMoE, GroupedExperts, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    num_experts, dim = ours.router.gate.weight.shape
    hidden = ours.experts.w1.shape[1]
    config = TitanMoE.Config(
        num_experts=num_experts, load_balance_coeff=None,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=dim, hidden_dim=hidden, num_experts=num_experts),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=num_experts, top_k=ours.top_k)),
        router=TokenChoiceTopKRouter.Config(num_experts=num_experts, top_k=ours.top_k, score_func="softmax",
                                            route_norm=True,
                                            gate=Linear.Config(in_features=dim, out_features=num_experts)))
    titan = config.build()
    with torch.no_grad():
        titan.router.gate.weight.copy_(ours.router.gate.weight)
        inner = titan.routed_experts.inner_experts
        inner.w1_EFD.copy_(ours.experts.w1)
        inner.w2_EDF.copy_(ours.experts.w2)
        inner.w3_EFD.copy_(ours.experts.w3)
    return titan


def _ours(num_experts: int, args: argparse.Namespace, device: torch.device) -> MoE:
    moe = MoE(args.dim, args.hidden, num_experts, args.top_k, norm_topk_prob=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return moe.to(device)


def _step_fn(module: nn.Module, x: torch.Tensor, target: torch.Tensor,
             optimizer: torch.optim.Optimizer = None) -> Callable[[], float]:
    def step() -> float:
        out = module(x)
        loss = F.mse_loss(out.float(), target)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            module.zero_grad(set_to_none=True)
        return loss.item()
    return step


def _time_pair(steps: Dict[str, Callable[[], float]], n: int, device: torch.device) -> Dict[str, float]:
    """Median seconds per step of each callable, alternating (two warm-up steps each): this
    process's CPU time on CPU (a shared machine's other jobs do not count), wall time on CUDA."""
    for step in steps.values():
        step(), step()
    times: Dict[str, List[float]] = {name: [] for name in steps}
    names = list(steps)
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    for i in range(n):
        for name in names if i % 2 == 0 else names[::-1]:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = clock()
            steps[name]()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(clock() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _syncs(module: MoE, x: torch.Tensor, target: torch.Tensor) -> Dict[str, int]:
    """Host reads in one forward + backward of ``module`` (the loss's value not read)."""
    def step():
        F.mse_loss(module(x).float(), target).backward()
        module.zero_grad(set_to_none=True)
    step()  # warm-up
    if x.device.type == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return {"synchronizing operations (set_sync_debug_mode)": sum("synchroniz" in str(w.message) for w in caught)}
    with counted_host_reads() as counts:
        step()
    return dict(counts)


def run(args: argparse.Namespace) -> Dict[str, dict]:
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    if not dist.is_initialized():  # fully_shard needs a process group: one rank
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    results = {}
    g = torch.Generator().manual_seed(1)
    # (1, tokens, dim): torchtitan's layer takes (batch, seq, dim)
    x32 = torch.randn(1, args.tokens, args.dim, generator=g).to(device)
    target = torch.randn(1, args.tokens, args.dim, generator=g).to(device)
    for num_experts in args.experts:
        ours = _ours(num_experts, args, device)
        row: Dict[str, object] = {}
        if "torchtitan" in args.only and not args.skip_torchtitan:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            titan = _torchtitan_moe(ours).to(device)
            ours_sharded = copy.deepcopy(ours)
            for module in (ours_sharded, titan):
                fully_shard(module, mp_policy=mp)
            with torch.no_grad():
                gap = (ours_sharded(x32) - titan(x32)).abs().max().item()
            steps = {name: _step_fn(m, x32, target, torch.optim.AdamW(m.parameters(), lr=1e-4))
                     for name, m in (("ours", ours_sharded), ("torchtitan", titan))}
            t = _time_pair(steps, args.steps, device)
            row["vs_torchtitan"] = {**t, "ratio": t["ours"] / t["torchtitan"], "max_output_gap_bf16": gap}
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        x, mine = x32.to(dtype), copy.deepcopy(ours).to(dtype)
        if "plain" in args.only:
            t = _time_pair({"ours": _step_fn(mine, x, target), "plain": _step_fn(PlainGroupedMoE(mine), x, target)},
                           args.steps, device)
            row["vs_plain"] = {**t, "ratio": t["ours"] / t["plain"], "dtype": str(dtype)}
        if "split" in args.only:
            split = copy.deepcopy(mine)
            split.experts.matmul = ExpertMatmul.SPLIT
            t = _time_pair({"grouped": _step_fn(mine, x, target), "split": _step_fn(split, x, target)},
                           args.steps, device)
            row["grouped_vs_split"] = {**t, "ratio": t["grouped"] / t["split"], "dtype": str(dtype)}
        if "syncs" in args.only:
            row["host_reads_per_step"] = _syncs(mine, x, target)
        results[f"{num_experts} experts"] = row
    return results


def main(argv=None) -> None:
    args = _parse_args(argv)
    results = run(args)
    threads = torch.get_num_threads() if args.device == "cpu" else 1
    clock = "CPU time" if args.device == "cpu" else "wall time"
    print(f"MoE layer: dim {args.dim}, expert hidden {args.hidden}, top-{args.top_k}, {args.tokens} tokens/step, "
          f"{args.device} ({threads} threads), torch {torch.__version__}, median {clock} of {args.steps} "
          f"alternating steps")
    for shape, row in results.items():
        print(f"\n{shape}")
        for name, value in row.items():
            if isinstance(value, dict) and "ratio" in value:
                times = "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in value.items() if isinstance(v, float)
                                  and k not in ("ratio", "max_output_gap_bf16"))
                extra = f"  (output gap {value['max_output_gap_bf16']:.2e})" if "max_output_gap_bf16" in value else ""
                print(f"  {name:18} {times}  ratio {value['ratio']:.3f}{extra}")
            else:
                print(f"  {name:18} {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "results": results}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
