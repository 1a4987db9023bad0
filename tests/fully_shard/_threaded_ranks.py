"""Run by test_threaded_ranks.py in a fresh process: fully_shard on 4 ranks that are threads
of this process (torch's threaded process group, as in torch's MultiThreadedTestCase)."""

from __future__ import annotations

import copy
import os
import sys
import threading
import traceback

os.environ["HYPER_PARALLEL_DEVICE"] = "cpu"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402
from torch.testing._internal.distributed.multi_threaded_pg import (  # noqa: E402
    _install_threaded_pg, _uninstall_threaded_pg)

import hyper_parallel as hp  # noqa: E402

WORLD, DIM, HIDDEN = 4, 8, 6  # HIDDEN over 4 ranks: uneven shards (2, 2, 2, 0)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, DIM)).double()


def _mean_square_loss(model, x):
    return (model(x) ** 2).mean()


def _rank_main(rank, store, models, batches, results):
    dist.init_process_group("threaded", rank=rank, world_size=WORLD, store=store)
    diffs = []
    for reference in models:  # a second model hits the (per-rank) mesh and subgroup caches
        model = copy.deepcopy(reference)
        # Smaller post-forward groups (a subgroup per rank pair), with dim-0 and dim-1 shards.
        hp.fully_shard(model[0], reshard_after_forward=2)
        hp.fully_shard(model[2], reshard_after_forward=2, shard_placement_fn=lambda p: Shard(p.ndim - 1))
        hp.fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for batch in batches:
            _mean_square_loss(model, batch.chunk(WORLD)[rank]).backward()
            opt.step()
            opt.zero_grad()
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
        diffs.append(full)
    results[rank] = diffs


def main() -> int:
    torch.manual_seed(0)
    models = [_model(), _model()]
    batches = [torch.randn(8, DIM, dtype=torch.float64) for _ in range(2)]
    expected = []
    for reference in models:  # single-process training on the global batch
        reference = copy.deepcopy(reference)
        opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for batch in batches:
            _mean_square_loss(reference, batch).backward()
            opt.step()
            opt.zero_grad()
        expected.append(reference.state_dict())
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # as MultiThreadedTestCase does
    _install_threaded_pg()
    store = dist.HashStore()
    results, errors = [None] * WORLD, []

    def run(rank):
        try:
            _rank_main(rank, store, models, batches, results)
        except BaseException:  # noqa: BLE001 - reported below
            errors.append(f"rank {rank}:\n{traceback.format_exc()}")
            print(errors[-1], flush=True)

    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _uninstall_threaded_pg()
    if errors:
        print(errors[0])
        return 1
    worst = max((results[r][m][k] - expected[m][k]).abs().max().item()
                for r in range(WORLD) for m in range(len(models)) for k in expected[m])
    print(f"max diff {worst:.3e}")
    return 0 if worst <= 1e-12 else 1


if __name__ == "__main__":
    sys.exit(main())
