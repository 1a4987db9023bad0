"""Checkpoints on S3 (a local moto server): hyper_parallel.checkpoint vs torch DCP's fsspec storage.

Starts moto's S3 server on 127.0.0.1 (a free port; stopped by its process id at the end) and 2
gloo CPU ranks with a sharded state of about ``--mb`` MB: parameters plus AdamW moments as
``Shard(0)`` DTensors. Per repetition, in alternating order: a save with each library
(``hdcp.save`` to ``s3://.../ours-N``, ``dcp.save`` with torch's
fsspec ``FsspecWriter``: public from torch 2.15, a private module before, reached through
``hyper_parallel._torch_compat.dcp_fsspec_storage``), then a resharding load of each into ``Shard(1)`` targets (ours with
verification on, the default; ``FsspecReader`` for DCP), checked equal to the saved values.
Reported: median wall times, the ratios (DCP time / ours: above 1 we are faster), and the bytes
each library's resharding load fetched (``ContentLength`` of every GET, counted by wrapping
s3fs's request call in each rank) against the bytes it stored (the objects' sizes).
Both libraries use their defaults (one upload thread per rank).

    python benchmarks/checkpoint_s3.py [--mb 256] [--reps 3]

Needs ``moto[server]`` and ``s3fs``. Prints a Markdown report on rank 0.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform as host_platform
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hyper_parallel.checkpoint as hdcp  # noqa: E402
from hyper_parallel.core.distributed_checkpoint.format.checksum import describe_crc32  # noqa: E402
from benchmarks.launch import launch  # noqa: E402
from hyper_parallel._torch_compat import dcp_fsspec_storage  # noqa: E402
from hyper_parallel.platform import free_port  # noqa: E402

DcpFsspecWriter, DcpFsspecReader = dcp_fsspec_storage()

ROWS, COLS = 1024, 1024  # one tensor: 4 MiB in fp32
BUCKET = "bench"
_FETCHED = [0]  # bytes of GET responses in this process


def _count_gets() -> None:
    """Add every GET's ``ContentLength`` to ``_FETCHED`` (both libraries read through s3fs)."""
    import s3fs

    original = s3fs.S3FileSystem._call_s3

    async def counted(self, method, *args, **kwargs):
        out = await original(self, method, *args, **kwargs)
        if method == "get_object":
            _FETCHED[0] += int(out.get("ContentLength", 0))
        return out

    s3fs.S3FileSystem._call_s3 = counted


def _start_server() -> subprocess.Popen:
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"moto server did not start on {endpoint}")
            time.sleep(0.2)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=endpoint)
    return proc


def _state(mesh, n: int, placement) -> Dict[str, object]:
    gen = torch.Generator().manual_seed(0)

    def tensor() -> DTensor:
        return distribute_tensor(torch.randn(ROWS, COLS, generator=gen), mesh, [placement], src_data_rank=None)

    model = {f"layers.{i}.weight": tensor() for i in range(n)}
    optim = {f"layers.{i}.weight": {"exp_avg": tensor(), "exp_avg_sq": tensor()} for i in range(n)}
    return {"model": model, "optim": optim, "step": 10}


def _zeros_like(state):
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else 0


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, DTensor):
        return torch.equal(a.to_local(), b.to_local())
    return a == b


def _timed(fn: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _sum(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def _stored_bytes(url: str) -> int:
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    return sum(fs.du(url[len("s3://"):], total=False).values())


def _run(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    n = max(1, int(args.mb * 2**20 / (3 * ROWS * COLS * 4)))
    saved = _state(mesh, n, Shard(0))
    expected = _state(mesh, n, Shard(1))
    _count_gets()
    libraries = {
        "ours": (lambda url: hdcp.save(saved, checkpoint_id=url),
                 lambda url, target: hdcp.load(target, checkpoint_id=url)),
        "dcp": (lambda url: dcp.save(saved, storage_writer=DcpFsspecWriter(url)),
                lambda url, target: dcp.load(target, storage_reader=DcpFsspecReader(url))),
    }
    times: Dict[str, Dict[str, List[float]]] = {lib: {"save": [], "load": []} for lib in libraries}
    fetched: Dict[str, float] = {}
    stored: Dict[str, int] = {}
    for rep in range(args.reps):
        order = list(libraries) if rep % 2 == 0 else list(reversed(libraries))
        for lib in order:
            url = f"s3://{BUCKET}/{lib}-{rep}"
            times[lib]["save"].append(_timed(lambda: libraries[lib][0](url)))
        for lib in order:
            url = f"s3://{BUCKET}/{lib}-{rep}"
            target = _zeros_like(expected)
            before = _FETCHED[0]
            times[lib]["load"].append(_timed(lambda: libraries[lib][1](url, target)))
            fetched[lib] = _sum(_FETCHED[0] - before)
            if not _equal(expected, target):
                raise SystemExit(f"{lib}: the resharding load does not match the saved values")
            if rank == 0:
                stored[lib] = _stored_bytes(url)
        dist.barrier()
        if rank == 0:  # the bucket holds one repetition at a time (moto keeps objects in memory)
            import s3fs

            fs = s3fs.S3FileSystem()
            for lib in libraries:
                fs.rm(f"{BUCKET}/{lib}-{rep}", recursive=True)
        dist.barrier()
    if rank == 0:
        _report(args, n, world, times, fetched, stored)
    dist.destroy_process_group()


def _report(args, n, world, times, fetched, stored) -> None:
    state_bytes = 3 * n * ROWS * COLS * 4
    med = {lib: {op: statistics.median(v) for op, v in ops.items()} for lib, ops in times.items()}
    print(f"## Checkpoints on S3 (moto server on 127.0.0.1): hyper_parallel vs torch DCP fsspec storage\n")
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, torch {torch.__version__}, "
          f"{host_platform.machine()} with {os.cpu_count()} cores, {world} gloo ranks, state "
          f"{state_bytes / 1e9:.3f} GB ({3 * n} fp32 tensors of {ROWS}x{COLS}), {args.reps} repetitions "
          f"(medians; order alternating), our checksums: {describe_crc32()}\n")
    print("| | ours (s) | DCP (s) | DCP / ours | ours GB/s | DCP GB/s |")
    print("|---|---|---|---|---|---|")
    for op, label in (("save", "save"), ("load", "resharding load (Shard(0) -> Shard(1))")):
        o, d = med["ours"][op], med["dcp"][op]
        print(f"| {label} | {o:.2f} | {d:.2f} | {d / o:.2f}x | {state_bytes / o / 1e9:.3f} | "
              f"{state_bytes / d / 1e9:.3f} |")
    print("\n| | stored bytes | fetched by the resharding load | fetched / stored |")
    print("|---|---|---|---|")
    for lib in ("ours", "dcp"):
        print(f"| {lib} | {stored[lib]:,} | {int(fetched[lib]):,} | {fetched[lib] / stored[lib]:.2f}x |")
    print("\nall runs:", {lib: {op: [round(t, 2) for t in v] for op, v in ops.items()} for lib, ops in times.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=256.0, help="state size in MB (params + 2 moments)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu"])
    args = parser.parse_args()
    server = _start_server()
    try:
        import s3fs

        s3fs.S3FileSystem().mkdir(BUCKET)
        launch(_run, args, world=2)
    finally:
        server.terminate()  # our child, by its pid
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
