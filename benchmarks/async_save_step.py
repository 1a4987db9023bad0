"""What a checkpoint costs a training loop: the step time with ``CheckpointManager.save`` every
step, for a sync save, ``async_save`` staging in the caller (the default) and ``async_save``
with the background stager (``stage_in_background=True``), against no checkpoint at all.

A Llama-style model under ``hp.fully_shard`` (each block, then the root) with AdamW, on 2 gloo
CPU ranks spawned here (or under torchrun: ``--device cuda``). The modes run in turn for
``--steps`` steps each, ``--rounds`` times (the order alternates, so machine load hits all
alike); a step is forward + backward + ``optimizer.step()`` + ``zero_grad`` + ``manager.save``,
timed on the slowest rank (and the CPU time of all ranks' threads: on CPU the background
copy shares the cores with the step). The background stager's copy overlaps the next step's forward and
backward; its optimizer pre-hook makes ``optimizer.step()`` wait for it.

    python benchmarks/async_save_step.py [--model llama_50m] [--seq 128] [--steps 4] [--rounds 2]
        [--dir /tmp/hp_async_step]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

import hyper_parallel as hp
import hyper_parallel.checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.format.checksum import describe_crc32
from hyper_parallel.models import build_llama
from hyper_parallel.platform import get_platform

from launch import launch

# mode -> CheckpointManager arguments (None: no checkpoint)
MODES: Dict[str, Optional[dict]] = {
    "no checkpoint": None,
    "sync save": dict(async_save=False),
    "async_save, staging in the caller (default)": dict(async_save=True),
    "async_save, stage_in_background": dict(async_save=True, stage_in_background=True),
}


def _over_ranks(seconds: float, op=dist.ReduceOp.MAX) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=get_platform().current_device())
    dist.all_reduce(t, op=op)
    return float(t.item())


def main_in_group(args: argparse.Namespace) -> None:
    platform = get_platform()
    platform.set_device()
    if not platform.is_accelerator:
        torch.set_num_threads(1)
    dist.init_process_group(platform.backend)
    rank = dist.get_rank()
    mesh = hp.init_device_mesh(platform.device_type, (dist.get_world_size(),))
    torch.manual_seed(0)
    model = build_llama(args.model).to(platform.current_device())
    for block in model.layers:
        hp.fully_shard(block, mesh=mesh)
    hp.fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, model.cfg.vocab_size, (args.batch, args.seq + 1),
                           device=platform.current_device())
    state = {"model": hdcp.ModelState(model), "optim": hdcp.OptimizerState(model, optimizer)}

    def step(manager: Optional[hdcp.CheckpointManager], n: int) -> None:
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if manager is not None:
            manager.save(n, state)

    times: Dict[str, List[float]] = {mode: [] for mode in MODES}
    cpu: Dict[str, List[float]] = {mode: [] for mode in MODES}
    step_no = 0
    for round_no in range(args.rounds + 1):  # round 0 warms up (first saves allocate staging slabs)
        order = list(MODES) if round_no % 2 == 0 else list(reversed(MODES))
        for mode in order:
            folder = os.path.join(args.dir, f"round{round_no}-{list(MODES).index(mode)}")
            manager = None if MODES[mode] is None else hdcp.CheckpointManager(folder, keep_last_n=1, **MODES[mode])
            for _ in range(args.steps if round_no else 1):
                dist.barrier()
                start, cpu_start = time.perf_counter(), time.process_time()
                step(manager, step_no)
                platform.synchronize()
                elapsed = _over_ranks(time.perf_counter() - start)
                cpu_s = _over_ranks(time.process_time() - cpu_start, dist.ReduceOp.SUM)
                if round_no:
                    times[mode].append(elapsed)
                    cpu[mode].append(cpu_s)
                step_no += 1
            if manager is not None:
                manager.close()  # waits for the last save (not timed: the loop would go on)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
    if rank == 0:
        _report(args, model, times, cpu)
    dist.destroy_process_group()


def _report(args: argparse.Namespace, model: torch.nn.Module, times: Dict[str, List[float]],
            cpu: Dict[str, List[float]]) -> None:
    params = sum(p.numel() for p in model.parameters())
    base = statistics.median(times["no checkpoint"])
    print(f"\nmodel {args.model} ({params / 1e6:.1f} M parameters; checkpoint ~{params * 12 / 1e9:.2f} GB of "
          f"fp32 params + AdamW moments), batch {args.batch} x seq {args.seq}, {dist.get_world_size()} "
          f"{args.device} ranks, torch {torch.__version__}, a save every step, "
          f"{args.rounds} rounds x {args.steps} steps per mode, checksums: {describe_crc32()}; load average "
          + " ".join(f"{x:.1f}" for x in os.getloadavg()) + "\n")
    print("| mode | step s, median (runs) | per checkpoint vs no checkpoint | CPU s per step, all ranks and "
          "threads (median) |")
    print("|---|---|---|---|")
    for mode, runs in times.items():
        median = statistics.median(runs)
        extra = "" if mode == "no checkpoint" else f"{median - base:+.3f} s ({(median - base) / base:+.0%})"
        print(f"| {mode} | {median:.3f} ({', '.join(f'{t:.2f}' for t in runs)}) | {extra} | "
              f"{statistics.median(cpu[mode]):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama_50m", help="a name in hyper_parallel.models.llama.CONFIGS")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/hp_async_step", help="scratch folder (deleted afterwards)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--world", type=int, default=2, help="gloo ranks to spawn on CPU")
    args = parser.parse_args()
    launch(main_in_group, args, args.world)


if __name__ == "__main__":
    main()
