"""Start a benchmark on every rank: as launched under torchrun, else as gloo ranks spawned here."""

from __future__ import annotations

import argparse
import functools
import os
from typing import Callable, Dict, TypeVar

import torch.distributed as dist
import torch.multiprocessing as mp

import hyper_parallel as hp
from hyper_parallel.platform import free_port

R = TypeVar("R")


def launch(main_in_group: Callable[[argparse.Namespace], None], args: argparse.Namespace, world: int) -> None:
    """Run ``main_in_group(args)`` on every rank: under torchrun on the ranks it started, else on
    ``world`` gloo ranks on CPU spawned from this process (``args.device`` must be ``cpu``)."""
    if "WORLD_SIZE" in os.environ:  # torchrun
        main_in_group(args)
        return
    if args.device != "cpu":
        raise SystemExit(f"--device {args.device}: launch with torchrun --nproc_per_node=<GPUs>")
    mp.spawn(_spawned, args=(world, free_port(), main_in_group, args), nprocs=world, join=True)


def _spawned(rank: int, world: int, port: int, main_in_group: Callable[[argparse.Namespace], None],
             args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), HYPER_PARALLEL_DEVICE="cpu")
    main_in_group(args)


def run_and_report(args: argparse.Namespace, run_fn: Callable[[argparse.Namespace], Dict[str, R]],
                   report_fn: Callable[[argparse.Namespace, Dict[str, R]], None]) -> None:
    """On this rank: join the process group on ``args.device``, ``run_fn(args)``, and on rank 0
    ``report_fn(args, results)``."""
    os.environ.setdefault("HYPER_PARALLEL_DEVICE", args.device)
    platform = hp.init_distributed()
    if platform.device_type != args.device:
        raise SystemExit(f"--device {args.device} but the platform is {platform.device_type}")
    try:
        results = run_fn(args)
        if dist.get_rank() == 0:
            report_fn(args, results)
    finally:
        dist.destroy_process_group()


def launch_benchmark(run_fn: Callable[[argparse.Namespace], Dict[str, R]],
                     report_fn: Callable[[argparse.Namespace, Dict[str, R]], None],
                     args: argparse.Namespace, world: int) -> None:
    """:func:`launch` of :func:`run_and_report` with ``run_fn`` and ``report_fn`` (module-level
    functions, so that spawned ranks can unpickle them)."""
    launch(functools.partial(run_and_report, run_fn=run_fn, report_fn=report_fn), args, world)
