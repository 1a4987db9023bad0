"""Context parallelism on CPU: peak step memory per rank and step time vs sequence length, CP1/CP2/CP4.

One Llama model sharded with ``hp.fully_shard`` over all ``--world`` gloo ranks (FSDP over dp x
cp, as torchtitan), AdamW. For each sequence length and each CP degree ``cp`` (the world is
split dp = world / cp x cp), every CP group trains on one sequence of that length per step: CP1
is plain data parallelism (each rank holds a whole sequence, attention is torch's SDPA), CPn
runs the model inside ``context_parallel`` (ring attention, ``--rotate``) with each rank holding
1/n of its group's sequence. The loss is ``mean_token_loss`` over all ranks.

    python benchmarks/cp_step.py [--seqs 256 512 1024] [--cps 1 2 4] [--world 4] [--steps 3]

Memory, as ``fsdp_step.py`` measures it (its helpers are imported; ``benchmarks/README.md``):
glibc returns every freed block of >= 64 KiB to the OS, and the figure is the peak RSS during one
step (after an unmeasured step of the same shape) minus the RSS before it, maximum over ranks:
activations, unsharded parameters, gradients and communication buffers; the parameters, their
shards and the optimizer state exist before the step and do not count. Only the activations
change with ``cp``. Time: ``--steps`` steps per (seq, cp), the CP degrees alternating in order
per round; median of the slowest rank's step (wall and process CPU time: on a shared machine the
CPU time is the steadier figure); tokens/s counts all ranks' tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.models import build_llama
from hyper_parallel.parallel.context import context_parallel, mean_token_loss

from fsdp_step import (_over_ranks, _reset_peak_rss, _rss_bytes, _trimmed_rss_bytes, _use_mmap_for_large_blocks)
from launch import launch_benchmark

MB = 2**20


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--world", type=int, default=4, help="ranks spawned without torchrun")
    p.add_argument("--steps", type=int, default=3, help="timed steps per (seq, cp)")
    p.add_argument("--model", default="llama_debug")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rotate", choices=["ring", "allgather"], default="ring")
    p.add_argument("--device", default="cpu", choices=["cpu"])
    return p.parse_args(argv)


def _setting(world: int, cp: int) -> Tuple[hp.DeviceMesh, int]:
    """The (dp, cp) mesh (every rank calls this for every cp, in the same order) and the dp index."""
    if world % cp:
        raise SystemExit(f"--cps: {cp} does not divide the world size {world}")
    mesh = hp.init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("dp", "cp"))
    return mesh, mesh.get_local_rank("dp")


def _step(model, optimizer, tokens: torch.Tensor, mesh, args) -> float:
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    cp_size = mesh["cp"].size()
    scope = (context_parallel(mesh["cp"], rotate=args.rotate) if cp_size > 1 else contextlib.nullcontext())
    with scope as cp:
        if cp is not None:
            inputs, labels = cp.shard(inputs), cp.shard(labels)
        loss = mean_token_loss(model(inputs), labels, group=dist.group.WORLD)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def run(args: argparse.Namespace) -> Dict[Tuple[int, int], dict]:
    torch.set_num_threads(1)
    _use_mmap_for_large_blocks()
    world = dist.get_world_size()
    settings = {cp: _setting(world, cp) for cp in args.cps}
    model = build_llama(args.model, dim=args.dim, n_layers=args.layers, max_seq_len=max(args.seqs))
    for block in model.layers.values():
        hp.fully_shard(block)
    hp.fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.cfg.vocab_size
    results: Dict[Tuple[int, int], dict] = {}
    for seq in args.seqs:
        batches = {}
        for cp, (mesh, dp_index) in settings.items():
            gen = torch.Generator().manual_seed(1000 * seq + dp_index)
            batches[cp] = tokens = torch.randint(0, vocab, (1, seq + 1), generator=gen)
            _step(model, optimizer, tokens, mesh, args)  # unmeasured: same shapes, warm caches
            gc.collect()
            before = _trimmed_rss_bytes()
            _reset_peak_rss()
            _step(model, optimizer, tokens, mesh, args)
            peak = _over_ranks(_rss_bytes("VmHWM") - before)
            results[seq, cp] = {"peak_mb": peak / MB, "times": [], "cpu": []}
        for r in range(args.steps):
            order = args.cps if r % 2 == 0 else args.cps[::-1]
            for cp in order:
                dist.barrier()
                start, cpu_start = time.perf_counter(), time.process_time()
                _step(model, optimizer, batches[cp], settings[cp][0], args)
                results[seq, cp]["cpu"].append(_over_ranks(time.process_time() - cpu_start))
                results[seq, cp]["times"].append(_over_ranks(time.perf_counter() - start))
    return results


def _report(args: argparse.Namespace, results: Dict[Tuple[int, int], dict]) -> None:
    world = dist.get_world_size()
    print(f"\nllama {args.model} dim {args.dim} x {args.layers} layers, {world} gloo ranks, FSDP over all, "
          f"one sequence per CP group per step, rotate={args.rotate}, torch {torch.__version__}")
    print("| seq | CP | tokens/rank | peak step MB/rank | vs CP1 | step s (median) | CPU s/rank | tokens/s (all ranks) "
          "| vs CP1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for seq in args.seqs:
        base = results.get((seq, 1))
        for cp in args.cps:
            res = results[seq, cp]
            step = statistics.median(res["times"])
            tps = (world // cp) * seq / step
            mem_ratio = f"{res['peak_mb'] / base['peak_mb']:.2f}" if base else "-"
            tps_ratio = f"{tps / ((world * seq) / statistics.median(base['times'])):.2f}" if base else "-"
            print(f"| {seq} | {cp} | {seq // cp} | {res['peak_mb']:.1f} | {mem_ratio} | {step:.3f} "
                  f"| {statistics.median(res['cpu']):.3f} | {tps:.0f} | {tps_ratio} |")


def main(argv: List[str] = None) -> None:
    args = _parse_args(argv)
    launch_benchmark(run, _report, args, args.world)


if __name__ == "__main__":
    main()
