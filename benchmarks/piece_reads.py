"""A box with gaps (a column block of a row-major chunk): one ``preadv`` per piece vs its whole
rows read in a few large reads and copied out (``BlockReads.read_rows``), from the page cache.

The reader picks whole rows when the pieces lie less than 8 KiB apart (``filesystem/reader.py``
``_SPAN_GAP_BYTES``); this measures where the crossover lies on this machine.

    python benchmarks/piece_reads.py [--reps 15]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from hyper_parallel.core.distributed_checkpoint.filesystem.block_reads import BlockReads
from hyper_parallel.core.distributed_checkpoint.host_memory.bounce import read_box
from hyper_parallel.core.distributed_checkpoint.format.metadata import MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, ReadItem
from hyper_parallel.core.distributed_checkpoint.format.geometry import BoxGeometry

_CHUNK = 8 << 20  # bytes: one stored chunk of benchmarks/checkpoint_io.py's state


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"an 8 MiB fp32 chunk in the page cache, the box = the left half of every row; best of {args.reps}\n")
    print("| row | pieces (and gaps) | a preadv per piece | whole rows + copy |")
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "chunk.bin")
        for cols in (512, 1024, 2048, 4096, 16384):
            rows = _CHUNK // (cols * 4)
            chunk = torch.randn(rows, cols)
            chunk.numpy().tofile(path)
            sizes, offsets, lengths = (rows, cols), (0, 0), (rows, cols // 2)
            item = ReadItem(LoadItemType.TENSOR, MetadataIndex("w", (0, 0)), (0, 0), MetadataIndex("w", (0, 0)),
                            offsets, lengths)
            box = BoxGeometry(sizes, offsets, lengths)
            dest = torch.empty(lengths)
            fd = os.open(path, os.O_RDONLY)
            blocks = BlockReads()
            try:
                os.pread(fd, _CHUNK, 0)  # into the page cache
                per_piece = _best(lambda: read_box(fd, dest, box, 0, 4, path), args.reps)
                assert torch.equal(dest, chunk[:, :cols // 2])
                dest.zero_()
                whole_rows = _best(lambda: blocks.read_rows(fd, 0, sizes, item, dest, torch.float32, path), args.reps)
                assert torch.equal(dest, chunk[:, :cols // 2])
            finally:
                blocks.close()
                os.close(fd)
            print(f"| {cols * 4 // 1024} KiB | {rows} of {cols * 2 // 1024} KiB | {per_piece * 1e3:.1f} ms | "
                  f"{whole_rows * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
