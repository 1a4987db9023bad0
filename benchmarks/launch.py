"""Start a benchmark on every rank: as launched under torchrun, else as gloo ranks spawned here."""

from __future__ import annotations

import argparse
import os
from typing import Callable

import torch.multiprocessing as mp

from hyper_parallel.platform import free_port


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
