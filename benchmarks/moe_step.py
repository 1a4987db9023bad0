"""One MoE training step (forward + backward + AdamW) under torch's FSDP2 and under hp.fully_shard,
with expert parallelism: the same model, the same dispatch (``hp.ExpertParallel``), the experts on
their own data-parallel mesh through ``shard_placement_fn`` (torch's ``ShardPlacementResult``).

Per layout (EP2 x FSDP2 and EP4 on 4 ranks by default) both implementations wrap the same
``moe_debug``-shaped model (built on meta, initialised from seed 0), take two untimed steps (the
losses must agree; step 2 measures peak RSS and counts the all-to-all and all-gather bytes), then
alternate timed steps in the same processes. See ``benchmarks/README.md``.

    python benchmarks/moe_step.py [--eps 2 4] [--steps 4] [--seq 128] [--json out.json]
    torchrun --standalone --nproc_per_node=4 benchmarks/moe_step.py [--device cuda]

On an accelerator (``--device cuda``, nccl, one rank per GPU) the peak is the allocator's
peak allocated memory during step 2 instead of RSS.
"""

from __future__ import annotations

import argparse
import gc
import json
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict
from typing import Dict, Iterator, List

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.parallel import parallelize_module

import hyper_parallel as hp
from hyper_parallel.core.fully_shard import shard_on
from hyper_parallel.models import build_moe
from hyper_parallel.parallel.expert import ExpertParallel, expert_meshes
from hyper_parallel.platform import get_platform

from fsdp_step import (IMPLS, ImplResult, _counted_all_gathers, _over_ranks, _reset_peak_rss, _rss_bytes, _step,
                       _timed_step, _trimmed_rss_bytes, _use_mmap_for_large_blocks, print_ratios, print_table,
                       step_ratios)
from launch import launch_benchmark

_SHARD_FNS = {"torch": torch_fully_shard, "ours": hp.fully_shard}


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4, help="gloo ranks to spawn (without torchrun)")
    parser.add_argument("--eps", type=int, nargs="+", default=[2, 4], help="expert-parallel degrees to run")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per implementation and layout")
    parser.add_argument("--chunk", type=int, default=1, help="consecutive steps per turn when alternating")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo ranks; cuda: one rank per visible GPU (nccl, under torchrun)")
    parser.add_argument("--json", help="also write the results to this file (rank 0)")
    return parser.parse_args(argv)


@contextmanager
def _counted_all_to_alls() -> Iterator[Counter]:
    """Bytes this rank passes into ``dist.all_to_all_single`` (the dispatch's counts, tokens and
    their backward) inside the block, by dtype."""
    counts, original = Counter(), dist.all_to_all_single

    def counting(output, input, *args, **kwargs):
        counts[str(input.dtype).replace("torch.", "")] += input.numel() * input.element_size()
        return original(output, input, *args, **kwargs)
    dist.all_to_all_single = counting
    try:
        yield counts
    finally:
        dist.all_to_all_single = original


def _build(name: str, ep: int, args: argparse.Namespace) -> torch.nn.Module:
    """The model on meta, experts split over ``ep`` ranks, every block and the root sharded by
    ``name``'s fully_shard over all ranks with the experts over the other ``world / ep``."""
    with torch.device("meta"):
        model = build_moe("moe_debug", dim=args.dim, n_layers=args.layers, num_experts=args.experts,
                          max_seq_len=args.seq, aux_loss_weight=0.0)
    dp_shard = hp.init_device_mesh(args.device, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    ep_mesh, efsdp_mesh = expert_meshes(dp_shard, ep)
    shard = _SHARD_FNS[name]
    for block in model.layers.values():
        parallelize_module(block.moe.experts, ep_mesh, ExpertParallel())
        experts = set(block.moe.experts.parameters())
        expert_result = shard_on(efsdp_mesh)
        shard(block, mesh=dp_shard, shard_placement_fn=lambda p, e=experts: expert_result if p in e else None)
    shard(model, mesh=dp_shard)
    model.to_empty(device=get_platform().current_device())
    model.init_weights(seed=0)
    return model


def _measure(name: str, ep: int, tokens: torch.Tensor, result: ImplResult, args: argparse.Namespace,
             a2a: Dict[str, Dict[str, int]]):
    """Build + two steps; step 2's peak RSS over the RSS before the model existed (accelerator:
    the allocator's peak), and its bytes."""
    platform = get_platform()
    gc.collect()
    before = 0 if platform.is_accelerator else _trimmed_rss_bytes()
    model = _build(name, ep, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result.losses.append(_over_ranks(_step(model, optimizer, tokens), dist.ReduceOp.AVG))
    gc.collect()
    if platform.is_accelerator:
        platform.reset_peak_memory()
    else:
        _reset_peak_rss()
    with _counted_all_gathers() as gathered, _counted_all_to_alls() as exchanged:
        result.losses.append(_over_ranks(_step(model, optimizer, tokens), dist.ReduceOp.AVG))
    result.all_gather_bytes, a2a[name] = dict(gathered), dict(exchanged)
    gc.collect()
    if platform.is_accelerator:
        result.peak_step_bytes = int(_over_ranks(platform.peak_memory_bytes()))
        result.resident_bytes = int(_over_ranks(platform.device_module.memory_allocated()))
    else:
        result.peak_step_bytes = int(_over_ranks(_rss_bytes("VmHWM") - before))
        result.resident_bytes = int(_over_ranks(_rss_bytes("VmRSS") - before))
    return model, optimizer


def run(args: argparse.Namespace) -> Dict[int, tuple]:
    """Per ep degree: (results per implementation, all-to-all bytes per implementation)."""
    if args.device == "cpu":
        torch.set_num_threads(1)
        _use_mmap_for_large_blocks()
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(
        1000 + dist.get_rank())).to(get_platform().current_device())
    world = dist.get_world_size()
    bad = [ep for ep in args.eps if ep < 2 or world % ep or args.experts % ep]
    if bad:  # ep 1: the experts' mesh would be dp_shard's process group, which torch's FSDP2 refuses
        raise SystemExit(f"--eps {bad}: each must be >= 2 and divide the {world} ranks and --experts {args.experts}")
    out = {}
    for ep in args.eps:
        results, a2a = {name: ImplResult() for name in IMPLS}, {}
        for name in IMPLS:  # warm-up: one model and step of each, unmeasured
            warm = _build(name, ep, args)
            _step(warm, torch.optim.AdamW(warm.parameters(), lr=1e-3), tokens)
        del warm
        wrapped = {name: _measure(name, ep, tokens, results[name], args, a2a) for name in IMPLS}
        for r in range(-(-args.steps // args.chunk)):
            for name in IMPLS if r % 2 == 0 else IMPLS[::-1]:
                for _ in range(min(args.chunk, args.steps - len(results[name].step_times_s))):
                    _timed_step(*wrapped[name], tokens, results[name])
        del wrapped
        out[ep] = (results, a2a)
    return out


def _report(args: argparse.Namespace, out: Dict[int, tuple]) -> None:
    world, mb = dist.get_world_size(), 2**20
    summary: List[dict] = []
    for ep, (results, a2a) in out.items():
        layout = f"EP{ep}" + (f" x FSDP{world // ep}" if world > ep else "")
        print(f"\nMoE dim {args.dim}, {args.layers} layers, {args.experts} experts top-2, {layout} on {world} "
              f"{get_platform().backend} ranks (dense FSDP{world}), batch {args.batch}/rank x seq {args.seq}, fp32, "
              f"{args.steps} timed steps each (alternating, chunks of {args.chunk})")
        print_table(results)
        ratios = step_ratios(results)
        same = print_ratios(ratios, results)
        for name, r in results.items():
            print(f"{name:16}per step (rank 0): all-to-all {sum(a2a[name].values()) / mb:.3f} MB, "
                  f"all-gather {sum(r.all_gather_bytes.values()) / mb:.3f} MB")
        summary.append({"ep": ep, "ratios": ratios, "loss_match": same, "all_to_all_bytes": a2a,
                        "results": {n: asdict(r) for n, r in results.items()}})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "world_size": world, "layouts": summary}, f, indent=2)


def main(argv=None) -> None:
    args = _parse_args(argv)
    launch_benchmark(run, _report, args, args.world)


if __name__ == "__main__":
    main()
