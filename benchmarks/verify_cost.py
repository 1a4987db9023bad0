"""What verifying checksums on load costs (``load`` verifies by default; ``verify=False`` opts out).

Single process: saves a state of ``--mb`` MB (fp32 tensors of 16 MiB, fsynced), then loads it
with and without verification, each from a cold page cache when ``/proc/sys/vm/drop_caches``
is writable (disk speed) and from a warm one (memory speed, the worst case for the checksum's
share). Also reports the checksum functions' own throughput on one core: zlib's and ISA-L's
crc32 (the format's; ``checksum.crc32`` uses ISA-L's when installed), and crc32c / xxh3_64
when the ``crc32c`` / ``xxhash`` packages are importable; and both crc32s on 2 threads at
once (whether they release the GIL).

    python benchmarks/verify_cost.py [--mb 512] [--reps 3] [--dir /tmp/hp_verify_bench]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
from isal import isal_zlib

import hyper_parallel.checkpoint as hdcp
from checkpoint_io import drop_caches  # benchmarks/ is sys.path[0] when run as a script
from hyper_parallel.core.distributed_checkpoint.format import checksum

_TENSOR = 4 << 20  # fp32 elements per tensor: 16 MiB


def _hash_throughput(data: bytes) -> dict:
    fns = {"zlib.crc32": zlib.crc32, "isal crc32": isal_zlib.crc32}
    try:
        import crc32c
        fns["crc32c (hardware)" if crc32c.hardware_based else "crc32c (software)"] = crc32c.crc32c
    except ImportError:
        pass
    try:
        import xxhash
        fns["xxh3_64"] = xxhash.xxh3_64_intdigest
    except ImportError:
        pass
    out = {}
    for name, fn in fns.items():
        best = min(_timed(lambda: fn(data)) for _ in range(5))
        out[name] = len(data) / best / 1e9
    return out


def _two_threads(data: bytes) -> dict:
    """Aggregate GB/s of each crc32 on 2 threads, 2 buffers at once, over its 1-thread rate:
    about 2x if it releases the GIL (on 2 free cores), at most 1x if it holds it."""
    other = bytes(reversed(data))
    out = {}
    with ThreadPoolExecutor(2) as pool:
        for name, fn in (("zlib.crc32", zlib.crc32), ("isal crc32", isal_zlib.crc32)):
            one = min(_timed(lambda: fn(data)) for _ in range(5))
            two = min(_timed(lambda: list(pool.map(fn, (data, other)))) for _ in range(5))
            out[name] = (2 * len(data) / two / 1e9, 2 * one / two)
    return out


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/hp_verify_bench")
    args = parser.parse_args()
    torch.set_num_threads(1)
    n = max(1, args.mb * (1 << 20) // (4 * _TENSOR))
    state = {f"w{i}": torch.randn(_TENSOR) for i in range(n)}
    nbytes = n * _TENSOR * 4
    path = os.path.join(args.dir, "ckpt")
    shutil.rmtree(args.dir, ignore_errors=True)
    hdcp.save(state, checkpoint_id=path, no_dist=True)
    target = {k: torch.empty_like(v) for k, v in state.items()}
    cold = drop_caches()
    times = {}
    for rep in range(args.reps):
        for verify in ((True, False) if rep % 2 == 0 else (False, True)):
            for temperature in (("cold", "warm") if cold else ("warm",)):
                if temperature == "cold":
                    drop_caches()
                else:
                    hdcp.load(target, checkpoint_id=path, no_dist=True, verify=False)  # fill the cache
                t = _timed(lambda: hdcp.load(target, checkpoint_id=path, no_dist=True, verify=verify))
                times.setdefault((temperature, verify), []).append(t)
    assert all(torch.equal(target[k], state[k]) for k in state)
    hashes = _hash_throughput(state["w0"].numpy().tobytes())
    threads = _two_threads(state["w0"].numpy().tobytes())
    shutil.rmtree(args.dir, ignore_errors=True)
    print(f"host {platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}, state {nbytes / 1e6:.0f} MB "
          f"in {n} tensors, {args.reps} reps (median, GB/s = state bytes / load time), checksums: "
          f"{checksum.describe_crc32()}, load average at the end "
          + " ".join(f"{x:.1f}" for x in os.getloadavg()))
    print("| page cache | verify=True | verify=False | verification cost |")
    print("|---|---|---|---|")
    for temperature in ("cold", "warm"):
        if (temperature, True) not in times:
            continue
        on, off = statistics.median(times[(temperature, True)]), statistics.median(times[(temperature, False)])
        print(f"| {temperature} | {on:.3f} s ({nbytes / on / 1e9:.2f} GB/s) | {off:.3f} s ({nbytes / off / 1e9:.2f} GB/s) "
              f"| {100 * (on / off - 1):+.0f}% |")
    print("checksum throughput on one core (16 MiB buffer, best of 5): "
          + ", ".join(f"{name} {gbs:.2f} GB/s" for name, gbs in hashes.items()))
    print("2 threads on 2 buffers (GIL released: ~2x on 2 free cores): "
          + ", ".join(f"{name} {gbs:.2f} GB/s ({ratio:.2f}x one thread)" for name, (gbs, ratio) in threads.items()))


if __name__ == "__main__":
    main()
