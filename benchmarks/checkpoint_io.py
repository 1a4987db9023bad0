"""Checkpoint save/load throughput: hyper_parallel.checkpoint vs torch.distributed.checkpoint.

Runs on 2 gloo CPU ranks (spawned here; ``--device cuda``: one nccl rank per GPU, or
``--world N``, with the whole state in GPU memory) with a sharded state of about ``--gb`` GB:
parameters plus AdamW ``exp_avg``/``exp_avg_sq`` as ``Shard(0)`` DTensors. Per repetition, in alternating order:
torch DCP save/load (``FileSystemWriter(sync_files=True)``) and ours (fsync on), each save and
load from a synced, cold page cache when ``/proc/sys/vm/drop_caches`` is writable (reported), so
no run inherits the previous one's cached or dirty pages. Then a resharding
load (saved ``Shard(0)`` -> loaded ``Shard(1)``) with the bytes each rank read (``/proc/self/io``),
``async_save``'s blocking time and staging time vs a sync save (each library's default staging
and its background one: ``DefaultStager(use_async_staging)``, ``stage_in_background``), and the
disk's own fsynced write / cold read
bandwidth on the same file system (the ceiling; measured before and after, best counts).

    python benchmarks/checkpoint_io.py [--device cpu|cuda] [--world N] [--gb 1.0] [--reps 3]
        [--dir /tmp/hp_ckpt_bench]

Prints a Markdown report on rank 0. Everything written under ``--dir`` is deleted at the end.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform as host_platform
import shutil
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict_saver  # noqa: F401 - dcp.state_dict_saver.AsyncSaveResponse
import torch.multiprocessing as mp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import hyper_parallel.checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.format.checksum import describe_crc32
from hyper_parallel.utils.fileio import start_writeback
from hyper_parallel.platform import free_port, get_platform, reset_platform

ROWS, COLS = 4096, 1024  # one parameter: 16 MiB in fp32


# ----------------------------------------------------------------------------- helpers


def drop_caches() -> bool:
    """Evict the page cache so the next read comes from disk; False where not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def _io_counters() -> Dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def _barrier() -> None:
    dist.barrier()


def _timed(fn: Callable[[], object], cold: bool = False) -> tuple[float, Dict[str, float]]:
    """Wall time of ``fn`` across both ranks (barriers around it), this rank's I/O counters and
    its CPU time (``cpu_s``: all its threads; the figure that machine load disturbs least)."""
    _barrier()
    if cold:
        if dist.get_rank() == 0:
            drop_caches()
        _barrier()
    before = _io_counters()
    start, cpu_start = time.perf_counter(), time.process_time()
    fn()
    cpu = time.process_time() - cpu_start
    _sync_device()
    _barrier()
    elapsed = time.perf_counter() - start
    after = _io_counters()
    return elapsed, {**{k: after[k] - before[k] for k in ("rchar", "read_bytes", "wchar", "write_bytes")},
                     "cpu_s": cpu}


def _device() -> torch.device:
    """Where this rank's state lives (and where nccl wants collective tensors)."""
    return get_platform().current_device()


def _sync_device() -> None:
    """Finish queued device work, so a timing covers it (no-op on CPU)."""
    get_platform().synchronize()


def _sum_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.all_reduce(t)
    return float(t.item())


def _state(mesh, n_params: int, placement, seed: int) -> Dict[str, object]:
    """Params + AdamW moments as DTensors with ``placement`` (values identical for any placement)."""
    gen = torch.Generator().manual_seed(seed)

    def tensor() -> DTensor:
        return distribute_tensor(torch.randn(ROWS, COLS, generator=gen), mesh, [placement], src_data_rank=None)

    model = {f"layers.{i}.weight": tensor() for i in range(n_params)}
    optim = {f"layers.{i}.weight": {"exp_avg": tensor(), "exp_avg_sq": tensor(), "step": torch.tensor(10.0)}
             for i in range(n_params)}
    return {"model": model, "optim": {"state": optim}, "step": 10}


def _zeros_like(state):
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    return 0


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, DTensor):
        return torch.equal(a.to_local(), b.to_local())
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


def _tensor_bytes(state) -> int:
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, DTensor):
        return state.numel() * state.element_size()
    return 0


_PROBE_BLOCK = 8 << 20


def _disk_ceiling(directory: str, nbytes_per_rank: int) -> tuple[float, float]:
    """Both ranks write (fsync) then cold-read ``nbytes_per_rank`` each; aggregate GB/s. The
    write is timed twice: write-then-fsync, and with writeback started after every block (as
    our writer does); the faster counts. 8 MiB blocks: the size of one chunk of the state."""
    path = os.path.join(directory, f"disk_probe_{dist.get_rank()}.bin")
    block = torch.randint(0, 255, (_PROBE_BLOCK,), dtype=torch.uint8).numpy()

    def write(early_writeback: bool) -> None:
        if os.path.exists(path):
            os.remove(path)  # a fresh file each time, like a checkpoint (no truncate-and-rewrite)
        with open(path, "wb") as f:
            left, offset = nbytes_per_rank, 0
            while left > 0:
                n = f.write(block[: min(left, len(block))])
                if early_writeback:
                    f.flush()
                    start_writeback(f.fileno(), offset, n)
                left, offset = left - n, offset + n
            f.flush()
            os.fsync(f.fileno())

    def read() -> None:
        buffer = bytearray(b"\1" * _PROBE_BLOCK)  # pages already touched, like a live tensor
        fd = os.open(path, os.O_RDONLY)
        try:
            offset = 0
            while n := os.preadv(fd, [buffer], offset):
                offset += n
        finally:
            os.close(fd)

    total = nbytes_per_rank * dist.get_world_size()
    write_s = min(_timed(lambda: write(early), cold=True)[0] for early in (False, True))
    read_s, _ = _timed(read, cold=True)
    os.remove(path)
    return total / write_s / 1e9, total / read_s / 1e9


# ----------------------------------------------------------------------------- the run


def _run(rank: int, port: int, args) -> None:
    world = args.world
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), HYPER_PARALLEL_DEVICE=args.device)
    reset_platform()
    platform = get_platform()
    platform.set_device()
    if not platform.is_accelerator:
        torch.set_num_threads(1)
    dist.init_process_group(platform.backend, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10))
    mesh = init_device_mesh(platform.device_type, (world,))
    n_params = max(1, round(args.gb * 1e9 / (3 * ROWS * COLS * 4)))
    state = _state(mesh, n_params, Shard(0), seed=0)
    total = _tensor_bytes(state)
    root = args.dir
    if rank == 0:
        os.makedirs(root, exist_ok=True)
    _barrier()
    cold = drop_caches() if rank == 0 else False
    cold = bool(_sum_over_ranks(float(cold)))

    torch_dir, ours_dir = os.path.join(root, "torch_dcp"), os.path.join(root, "ours")

    def fresh(path: str) -> None:
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(os.path.join(root, f".{os.path.basename(path)}.staging"), ignore_errors=True)
        _barrier()

    impls = {
        "torch_dcp": (
            lambda sd: dcp.save(sd, storage_writer=dcp.FileSystemWriter(torch_dir, sync_files=True)),
            lambda sd: dcp.load(sd, storage_reader=dcp.FileSystemReader(torch_dir)),
            torch_dir,
        ),
        "hyper_parallel": (
            lambda sd: hdcp.save(sd, checkpoint_id=ours_dir),
            lambda sd: hdcp.load(sd, checkpoint_id=ours_dir, verify=args.verify == "on"),
            ours_dir,
        ),
    }
    times: Dict[str, Dict[str, List[float]]] = {name: {"save": [], "load": []} for name in impls}
    read_bytes: Dict[str, List[float]] = {name: [] for name in impls}
    load_cpu: Dict[str, List[float]] = {name: [] for name in impls}
    ceilings = [_disk_ceiling(root, total // world)]  # before and after the runs; best counts
    for name, (save_fn, _, path) in impls.items():  # warm-up: first-call costs are not I/O
        fresh(path)
        save_fn(state)
    for rep in range(args.reps):
        order = list(impls) if rep % 2 == 0 else list(reversed(impls))
        for name in order:
            save_fn, load_fn, path = impls[name]
            fresh(path)
            seconds, _ = _timed(lambda: save_fn(state), cold=cold)
            times[name]["save"].append(seconds)
            target = _zeros_like(state)
            seconds, io = _timed(lambda: load_fn(target), cold=cold)
            times[name]["load"].append(seconds)
            read_bytes[name].append(_sum_over_ranks(io["read_bytes"]))
            load_cpu[name].append(_sum_over_ranks(io["cpu_s"]))
            assert _equal(state, target), f"{name} load returned different values"
            del target

    # Resharding load: the Shard(0) checkpoints into a Shard(1) layout (reps, alternating order).
    reshard: Dict[str, Dict[str, object]] = {name: {"seconds": []} for name in impls}
    expected = _state(mesh, n_params, Shard(1), seed=0)
    for rep in range(args.reps):
        for name in (list(impls) if rep % 2 == 0 else list(reversed(impls))):
            _, load_fn, _ = impls[name]
            target = _zeros_like(expected)
            seconds, io = _timed(lambda: load_fn(target), cold=cold)
            assert _equal(expected, target), f"{name} resharding load returned different values"
            per_rank = [torch.zeros(2, dtype=torch.float64, device=_device()) for _ in range(world)]
            dist.all_gather(per_rank, torch.tensor([io["rchar"], io["read_bytes"]], dtype=torch.float64,
                                                   device=_device()))
            reshard[name]["seconds"].append(seconds)
            reshard[name].update(rchar=[float(t[0]) for t in per_rank], read_bytes=[float(t[1]) for t in per_rank])
            del target
    del expected

    # async_save: time until it returns (the training loop is blocked) vs a sync save.
    # Also until the state is staged; each library's default (blocking) staging and its background one.
    def torch_writer():
        return dcp.FileSystemWriter(torch_dir, sync_files=True)

    # torch's async_save runs its collectives on a background thread: it needs its own group,
    # or it deadlocks against the main thread's barriers on gloo.
    async_group = dist.new_group(backend="gloo")
    dcp_stager = DefaultStager(StagingOptions(use_pinned_memory=args.device == "cuda", use_shared_memory=False,
                                              use_async_staging=True, use_non_blocking_copy=args.device == "cuda"))

    def dcp_async(stager):
        response = dcp.async_save(state, storage_writer=torch_writer(), process_group=async_group,
                                  async_stager=stager)
        if isinstance(response, dcp.state_dict_saver.AsyncSaveResponse):
            return response.upload_completion, response.staging_completion
        return response, None

    def ours_async(background):
        future = hdcp.async_save(state, checkpoint_id=ours_dir, stage_in_background=background)
        return future, future.staging_completion

    sync_fns = {"torch_dcp": lambda: dcp.save(state, storage_writer=torch_writer()),
                "hyper_parallel": lambda: hdcp.save(state, checkpoint_id=ours_dir)}
    async_impls = {
        "torch_dcp": ("torch_dcp", lambda: dcp_async(None), torch_dir),
        "torch_dcp, DefaultStager(use_async_staging)": ("torch_dcp", lambda: dcp_async(dcp_stager), torch_dir),
        "hyper_parallel": ("hyper_parallel", lambda: ours_async(False), ours_dir),
        "hyper_parallel, stage_in_background": ("hyper_parallel", lambda: ours_async(True), ours_dir),
    }
    sync_times: Dict[str, float] = {}
    for lib, sync_fn in sync_fns.items():
        runs = []
        for _ in range(3):
            fresh(torch_dir if lib == "torch_dcp" else ours_dir)
            runs.append(_timed(sync_fn)[0])
        sync_times[lib] = statistics.median(runs)
    async_results: Dict[str, tuple[float, List[float], List[float]]] = {}
    for name, (lib, async_fn, path) in async_impls.items():
        blocks, staged = [], []
        for _ in range(4):  # the first call allocates staging buffers, later ones may reuse them
            fresh(path)
            start = time.perf_counter()
            done, staging = async_fn()
            returned = time.perf_counter() - start
            if staging is not None:
                staging.result()
            times_s = torch.tensor([returned, time.perf_counter() - start], dtype=torch.float64, device=_device())
            done.result()
            dist.all_reduce(times_s, op=dist.ReduceOp.MAX)  # the slowest rank's
            blocks.append(float(times_s[0]))
            staged.append(float(times_s[1]))
        async_results[name] = (sync_times[lib], blocks, staged)
    dcp_stager.close()

    fresh(torch_dir)
    fresh(ours_dir)
    ceilings.append(_disk_ceiling(root, total // world))
    write_gbs, read_gbs = (max(c[i] for c in ceilings) for i in (0, 1))
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        _report(args, total, cold, times, read_bytes, load_cpu, reshard, async_results, write_gbs, read_gbs)
    dist.destroy_process_group()


def _report(args, total, cold, times, read_bytes, load_cpu, reshard, async_results, write_gbs, read_gbs) -> None:
    gb = total / 1e9

    def rate(name: str, op: str, pick=statistics.median) -> float:
        return gb / pick(times[name][op])

    print(f"\n## checkpoint I/O run: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
    print(f"command: python benchmarks/checkpoint_io.py --device {args.device} --world {args.world} "
          f"--gb {args.gb} --reps {args.reps} --verify {args.verify} --dir {args.dir}")
    print(f"machine: {host_platform.node()} {host_platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {args.world} {args.device} rank(s) "
          f"({'nccl' if args.device == 'cuda' else 'gloo, 1 thread each'})"
          + (f", {torch.cuda.get_device_name(0)}" if args.device == "cuda" else "")
          + ", load average at the end {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))
    print(f"state: {gb:.3f} GB of fp32 DTensors (params + exp_avg + exp_avg_sq) in {args.device} memory, "
          f"Shard(0) over {args.world} rank(s); our checksums: {describe_crc32()}")
    print(f"saves and loads start {'COLD (synced, page cache dropped before each)' if cold else 'WARM (drop_caches not permitted)'}")
    print(f"disk ceiling (same file system, both ranks, fsync, best of before/after and of two write methods): "
          f"write {write_gbs:.2f} GB/s, "
          f"cold read {read_gbs:.2f} GB/s\n")
    print("One untimed warm-up save per implementation first; GB/s of the median and of the best run.\n")
    print("| | save GB/s median (best) | load GB/s median (best) | save s (runs) | load s (runs) "
          "| bytes read from disk per load | load CPU s, all ranks (median) |")
    print("|---|---|---|---|---|---|---|")
    for name in times:
        print(f"| {name} | {rate(name, 'save'):.2f} ({rate(name, 'save', min):.2f}) | "
              f"{rate(name, 'load'):.2f} ({rate(name, 'load', min):.2f}) | "
              f"{', '.join(f'{t:.2f}' for t in times[name]['save'])} | "
              f"{', '.join(f'{t:.2f}' for t in times[name]['load'])} | "
              f"{statistics.median(read_bytes[name]) / 1e9:.3f} GB | {statistics.median(load_cpu[name]):.3f} |")
    ours, ref = "hyper_parallel", "torch_dcp"
    for label, pick in (("median", statistics.median), ("best", min)):
        print(f"\n{label} runs: ours / torch DCP: save {rate(ours, 'save', pick) / rate(ref, 'save', pick):.2f}x, "
              f"load {rate(ours, 'load', pick) / rate(ref, 'load', pick):.2f}x (goal >= 1.5x); "
              f"ours vs disk ceiling: save {rate(ours, 'save', pick) / write_gbs:.0%} of write, "
              f"load {rate(ours, 'load', pick) / read_gbs:.0%} of read (goal >= 70%)")
    print()
    print(f"resharding load (saved Shard(0) -> loaded Shard(1), {args.world} rank(s)):\n")
    print("| | seconds (runs) | GB/s (median) | bytes read per rank (rchar) | total read / stored "
          "| from disk (read_bytes) / stored |")
    print("|---|---|---|---|---|---|")
    for name, r in reshard.items():
        per_rank = ", ".join(f"{b / 1e9:.3f} GB" for b in r["rchar"])
        print(f"| {name} | {', '.join(f'{t:.2f}' for t in r['seconds'])} | {gb / statistics.median(r['seconds']):.2f} "
              f"| {per_rank} | {sum(r['rchar']) / total:.2f}x | {sum(r['read_bytes']) / total:.2f}x |")
    speedup = statistics.median(reshard[ref]["seconds"]) / statistics.median(reshard[ours]["seconds"])
    print(f"\nresharding load, median: ours / torch DCP {speedup:.2f}x (goal >= 1.2x)")
    print("\nasync_save blocking time (until it returns) vs a sync save of the same state:\n")
    print("(slowest rank; also the time until the state is staged, with nothing else running)\n")
    print("| | async_save blocks, s (1st call; later calls) | staged after, s (1st; later) | sync save s, median of 3 "
          "| blocking / sync (median of later calls) |")
    print("|---|---|---|---|---|")
    for name, (sync_s, blocks, staged) in async_results.items():
        later = statistics.median(blocks[1:])
        print(f"| {name} | {blocks[0]:.3f}; {', '.join(f'{b:.3f}' for b in blocks[1:])} | {staged[0]:.3f}; "
              f"{', '.join(f'{b:.3f}' for b in staged[1:])} | {sync_s:.2f} | {later / sync_s:.1%} |")
    print(f"\n(goal for ours: <= 5% on CPU; load average at the end: {os.getloadavg()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="total state size in GB")
    parser.add_argument("--reps", type=int, default=3, help="save+load repetitions per implementation")
    parser.add_argument("--verify", choices=("on", "off"), default="on",
                        help="our loads check every crc32 (on: load's default; DCP checks none)")
    parser.add_argument("--dir", default="/tmp/hp_ckpt_bench", help="scratch directory (deleted afterwards)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the state lives: cpu (gloo ranks) or cuda (nccl, one rank per GPU)")
    parser.add_argument("--world", type=int, default=None,
                        help="ranks (default: 2 on cpu, every visible GPU on cuda)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to this torch build")
    if args.world is None:
        args.world = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.device == "cuda" and args.world > torch.cuda.device_count():
        parser.error(f"--world {args.world} needs that many GPUs; {torch.cuda.device_count()} visible")
    mp.spawn(_run, args=(free_port(), args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
