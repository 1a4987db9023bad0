"""The optimizer step alone (AdamW), for-loop vs foreach vs fused, on parameters sharded by
torch's FSDP2 and by hp.fully_shard, side by side in the same processes.

Each implementation wraps the same Llama-style model (each block, then the root); one
backward makes the gradients, then ``optimizer.step()`` is timed ``--reps`` times per setting
(the gradients stay, so every step does the same work), the implementations and settings
interleaved so machine load hits them alike. Reports the median of the slowest rank's time.

    python benchmarks/optimizer_step.py [--model llama_50m] [--reps 10] [--world 2]
    torchrun --standalone --nproc_per_node=$NGPU benchmarks/optimizer_step.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import hyper_parallel as hp
from hyper_parallel.models import build_llama
from hyper_parallel.models.llama import CONFIGS
from hyper_parallel.platform import get_platform
from hyper_parallel.trainer.setup.optimizer import mesh_groups

from launch import launch

SETTINGS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}
SHARD = {"torch FSDP2": torch_fully_shard, "hp.fully_shard": hp.fully_shard}


def _model(name: str, device: str, shard) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_llama(name).to(device)
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    for block in model.layers.values():
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    tokens = torch.randint(0, CONFIGS[name]["vocab_size"], (2, 65),
                           generator=torch.Generator().manual_seed(dist.get_rank())).to(device)
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    return model


def _timed_step(optimizer: torch.optim.Optimizer) -> float:
    get_platform().synchronize()
    start = time.perf_counter()
    optimizer.step()
    get_platform().synchronize()
    elapsed = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def run(args: argparse.Namespace) -> Dict[str, Dict[str, float]]:
    models = {impl: _model(args.model, args.device, shard) for impl, shard in SHARD.items()}
    optimizers = {(impl, setting): torch.optim.AdamW([{"params": g} for g in mesh_groups(model)], lr=1e-4, **kw)
                  for impl, model in models.items() for setting, kw in SETTINGS.items()}
    times: Dict[tuple, List[float]] = {key: [] for key in optimizers}
    for key, optimizer in optimizers.items():  # warm-up: the states are allocated on the first step
        _timed_step(optimizer)
    for _ in range(args.reps):
        for key, optimizer in optimizers.items():
            times[key].append(_timed_step(optimizer))
    result: Dict[str, Dict[str, float]] = {}
    for (impl, setting), values in times.items():
        result.setdefault(impl, {})[setting] = statistics.median(values) * 1e3
    return result


def _main_in_group(args: argparse.Namespace) -> None:
    hp.init_distributed()
    torch.set_num_threads(1)
    try:
        result = run(args)
        if dist.get_rank() == 0:
            params = sum(p.numel() for p in build_llama(args.model).parameters())
            print(f"AdamW step, median of {args.reps} (ms, slowest of {dist.get_world_size()} ranks), "
                  f"{args.model} ({params / 1e6:.1f} M parameters), {args.device}, torch {torch.__version__}")
            print(f"{'':16}" + "".join(f"{s:>10}" for s in SETTINGS))
            for impl, row in result.items():
                print(f"{impl:16}" + "".join(f"{row[s]:10.1f}" for s in SETTINGS))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama_50m")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--world", type=int, default=2, help="ranks to spawn on CPU")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    launch(_main_in_group, args, args.world)


if __name__ == "__main__":
    main()
