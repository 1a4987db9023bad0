"""One training step (forward + backward + AdamW) under torch's FSDP2 and under hp.fully_shard.

Both wrap the same Llama-style decoder (each block, then the root) from identical weights and
are timed alternately in the same processes, so machine load hits both alike. See
``benchmarks/README.md`` for what is measured and how.

    torchrun --standalone --nproc_per_node=2 benchmarks/fsdp_step.py [--steps N] [--json out.json]
    torchrun --standalone --nproc_per_node=4 benchmarks/fsdp_step.py --hsdp
    python benchmarks/fsdp_step.py [--hsdp]       # spawns the ranks itself (2, or 4 with --hsdp)
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.profiler import ProfilerActivity, profile

import hyper_parallel as hp
from hyper_parallel.models import build_llama
from hyper_parallel.platform import free_port

IMPLS = ("torch", "ours")
_SHARD_FNS = {"torch": lambda: torch_fully_shard, "ours": lambda: hp.fully_shard}
_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


@dataclass
class ImplResult:
    step_times_s: List[float] = field(default_factory=list)  # slowest rank's time per step
    cpu_times_s: List[float] = field(default_factory=list)  # largest per-rank process CPU time per step
    peak_step_bytes: int = 0  # max over ranks, see _build_impl
    resident_bytes: int = 0  # max over ranks, held between steps
    losses: List[float] = field(default_factory=list)  # global-batch loss at steps 1 and 2

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_times_s)

    @property
    def median_cpu_s(self) -> float:
        return statistics.median(self.cpu_times_s)


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hsdp", action="store_true", help="2x2 (replicate, shard) mesh on 4 ranks")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per implementation")
    parser.add_argument("--chunk", type=int, default=2, help="consecutive steps per turn when alternating")
    parser.add_argument("--model", default="llama_50m")
    parser.add_argument("--layers", type=int, help="override the model's number of blocks (groups)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--json", help="also write the results to this file (rank 0)")
    parser.add_argument("--profile", action="store_true",
                        help="print rank 0's torch.profiler op table for one extra step of each")
    return parser.parse_args(argv)


def _layer_override(args: argparse.Namespace) -> dict:
    return {} if args.layers is None else {"n_layers": args.layers}


def _wrap(model: torch.nn.Module, shard_fn: Callable, mesh) -> torch.nn.Module:
    for block in model.layers:
        shard_fn(block, mesh=mesh)
    shard_fn(model, mesh=mesh)
    return model


def _step(model, optimizer, tokens: torch.Tensor) -> float:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _use_mmap_for_large_blocks() -> None:
    """Make glibc return every freed block of >= 64 KiB to the OS, so RSS follows live tensors.

    Without this, glibc raises its mmap threshold after the first large frees and keeps later
    freed tensors in its heap, where they still count as resident.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError as err:
        raise SystemExit(f"the memory measurement needs glibc (Linux): {err}") from err
    if libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024) != 1:
        raise SystemExit("mallopt(M_MMAP_THRESHOLD) failed; RSS would not follow freed tensors")


def _rss_bytes(field_name: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak resident since the last reset) of this process."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # sets VmHWM to the current VmRSS


def _over_ranks(value: float, op=dist.ReduceOp.MAX) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.item()


def _warm_up(args, mesh, tokens) -> None:
    """One step of each implementation on a one-block model of the same shapes.

    Loads code, fills caches and thread pools that the first measured implementation would
    otherwise pay for alone.
    """
    for name in IMPLS:
        model = _wrap(build_llama(args.model, n_layers=1, max_seq_len=args.seq), _SHARD_FNS[name](), mesh)
        _step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), tokens)


def _build_impl(name: str, reference: torch.nn.Module, mesh, tokens, result: ImplResult):
    """Copy + wrap + two warm-up steps, measuring RSS growth; returns (model, optimizer).

    Memory figures are RSS increases over the RSS before this implementation's model copy
    existed: the peak during step 2 (all state exists by then) and what stays after it.
    """
    shard_fn = _SHARD_FNS[name]()
    gc.collect()
    before = _rss_bytes("VmRSS")
    model = _wrap(copy.deepcopy(reference), shard_fn, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result.losses.append(_over_ranks(_step(model, optimizer, tokens), dist.ReduceOp.AVG))
    gc.collect()
    _reset_peak_rss()
    result.losses.append(_over_ranks(_step(model, optimizer, tokens), dist.ReduceOp.AVG))
    result.peak_step_bytes = int(_over_ranks(_rss_bytes("VmHWM") - before))
    gc.collect()
    result.resident_bytes = int(_over_ranks(_rss_bytes("VmRSS") - before))
    return model, optimizer


def _timed_step(model, optimizer, tokens, result: ImplResult) -> None:
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    _step(model, optimizer, tokens)
    cpu, wall = time.process_time() - cpu_start, time.perf_counter() - start
    result.step_times_s.append(_over_ranks(wall))
    result.cpu_times_s.append(_over_ranks(cpu))


def run(args: argparse.Namespace) -> Dict[str, ImplResult]:
    """Build, measure and time both implementations on this rank; results are per implementation."""
    torch.set_num_threads(1)
    _use_mmap_for_large_blocks()
    world = dist.get_world_size()
    if args.hsdp:
        if world != 4:
            raise SystemExit(f"--hsdp needs 4 ranks (2x2 mesh), got {world}")
        mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = hp.init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    reference = build_llama(args.model, max_seq_len=args.seq, **_layer_override(args))
    vocab = reference.cfg.vocab_size
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1),
                           generator=torch.Generator().manual_seed(1000 + dist.get_rank()))

    _warm_up(args, mesh, tokens)
    results = {name: ImplResult() for name in IMPLS}
    wrapped = {name: _build_impl(name, reference, mesh, tokens, results[name]) for name in IMPLS}
    del reference

    for r in range(-(-args.steps // args.chunk)):
        order = IMPLS if r % 2 == 0 else IMPLS[::-1]  # alternate who goes first
        for name in order:
            for _ in range(min(args.chunk, args.steps - len(results[name].step_times_s))):
                _timed_step(*wrapped[name], tokens, results[name])

    if args.profile:
        for name in IMPLS:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                _step(*wrapped[name], tokens)
            if dist.get_rank() == 0:
                print(f"\n=== {name}: one step, rank 0, by self CPU time ===")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return results


def _report(args, results: Dict[str, ImplResult]) -> None:
    torch_r, ours_r = results["torch"], results["ours"]
    mb = 2**20
    layout = "HSDP 2x2" if args.hsdp else f"FSDP {dist.get_world_size()}"
    blocks = f" ({args.layers} blocks)" if args.layers is not None else ""
    print(f"\n{args.model}{blocks}, {layout} gloo ranks, batch {args.batch}/rank x seq {args.seq}, "
          f"{len(torch_r.step_times_s)} timed steps each (alternating, chunks of {args.chunk})")
    print(f"{'':16}{'median step s':>14}{'min..max s':>16}{'median CPU s':>14}{'peak step MB':>14}"
          f"{'resident MB':>13}{'loss@1':>12}{'loss@2':>12}")
    for name, r in results.items():
        spread = f"{min(r.step_times_s):.3f}..{max(r.step_times_s):.3f}"
        print(f"{name:16}{r.median_step_s:>14.3f}{spread:>16}{r.median_cpu_s:>14.3f}"
              f"{r.peak_step_bytes / mb:>14.1f}{r.resident_bytes / mb:>13.1f}"
              f"{r.losses[0]:>12.6f}{r.losses[1]:>12.6f}")
    ratios = {
        "step_time": ours_r.median_step_s / torch_r.median_step_s,
        "cpu_time": ours_r.median_cpu_s / torch_r.median_cpu_s,
        "peak_step_memory": ours_r.peak_step_bytes / torch_r.peak_step_bytes,
        "resident_memory": ours_r.resident_bytes / torch_r.resident_bytes,
    }
    print(f"{'ours/torch':16}{ratios['step_time']:>14.3f}{'':16}{ratios['cpu_time']:>14.3f}"
          f"{ratios['peak_step_memory']:>14.3f}{ratios['resident_memory']:>13.3f}")
    loss_diffs = [abs(a - b) for a, b in zip(ours_r.losses, torch_r.losses)]
    same = all(d <= 1e-4 * abs(t) for d, t in zip(loss_diffs, torch_r.losses))
    print(f"loss sanity (steps 1-2, |ours - torch|): {', '.join(f'{d:.2e}' for d in loss_diffs)}"
          f" -> {'OK' if same else 'MISMATCH'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "world_size": dist.get_world_size(), "ratios": ratios,
                       "loss_match": same,
                       "results": {n: {**asdict(r), "median_step_s": r.median_step_s,
                                       "median_cpu_s": r.median_cpu_s}
                                   for n, r in results.items()}}, f, indent=2)


def _main_in_group(args: argparse.Namespace) -> None:
    os.environ.setdefault("HYPER_PARALLEL_DEVICE", "cpu")  # the memory tracker is CPU-only
    hp.init_distributed()
    try:
        results = run(args)
        if dist.get_rank() == 0:
            _report(args, results)
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), HYPER_PARALLEL_DEVICE="cpu")
    _main_in_group(args)


def main(argv=None) -> None:
    args = _parse_args(argv)
    if "WORLD_SIZE" in os.environ:  # torchrun
        _main_in_group(args)
        return
    world = 4 if args.hsdp else 2
    mp.spawn(_spawned, args=(world, free_port(), args), nprocs=world, join=True)


if __name__ == "__main__":
    main()
