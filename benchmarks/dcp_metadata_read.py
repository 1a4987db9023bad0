"""Reading a large torch DCP ``.metadata``: the restricted C unpickler alone (as before the
opcode pre-scan), with the pre-scan (what ``import-dcp`` runs), and a restricted pure-Python
unpickler (the alternative: a dict memo needs no pre-scan).

Two files: the ``.metadata`` that ``torch.distributed.checkpoint.save`` writes for ``--tensors``
(10, 4) float32 tensors (one process), and the same metadata with every tensor split into
``--chunks`` row chunks (as that many ranks' row shards give), pickled as DCP's
``FileSystemWriter`` does (``pickle.dump``).

    python benchmarks/dcp_metadata_read.py [--tensors 20000] [--chunks 10] [--reps 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import pickle
import statistics
import tempfile
import time
import warnings
from typing import Any, Callable, Dict, List

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_md

from hyper_parallel.core.distributed_checkpoint.dcp_interop import unpickler


class _PurePythonUnpickler(pickle._Unpickler):  # Python's pure-Python unpickler (private name)
    find_class = unpickler._DcpUnpickler.find_class
    persistent_load = unpickler._DcpUnpickler.persistent_load

    def __init__(self, file: io.BytesIO, source: str) -> None:
        super().__init__(file)
        self.source = source


def _write(tmp: str, tensors: int, chunks: int) -> Dict[str, bytes]:
    state = {f"layers.{i // 10}.p{i % 10}.weight": torch.zeros(10, 4) for i in range(tensors)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no process group: DCP says it saves in one process)
        dcp.save(state, checkpoint_id=tmp)
    with open(os.path.join(tmp, ".metadata"), "rb") as f:
        saved = f.read()
    metadata = pickle.loads(saved)
    storage = {}
    for index, info in metadata.storage_data.items():
        rows = metadata.state_dict_metadata[index.fqn]
        rows.chunks = [dcp_md.ChunkStorageMetadata(torch.Size([r, 0]), torch.Size([10 // chunks, 4]))
                       for r in range(0, 10, 10 // chunks)]
        for n, chunk in enumerate(rows.chunks):
            storage[dcp_md.MetadataIndex(index.fqn, chunk.offsets, n)] = dataclasses.replace(
                info, offset=info.offset + n * 1000)
    metadata.storage_data = storage
    return {f"{tensors} tensors (dcp.save)": saved, f"{tensors * chunks} chunks": pickle.dumps(metadata)}


def _median_times(ways: Dict[str, Callable[[], Any]], reps: int) -> Dict[str, float]:
    times: Dict[str, List[float]] = {name: [] for name in ways}
    for _ in range(reps):  # alternating, so that a change of machine load falls on every way
        for name, way in ways.items():
            start = time.process_time()  # (CPU seconds: all single-threaded; robust to a loaded machine)
            way()
            times[name].append(time.process_time() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=20000)
    parser.add_argument("--chunks", type=int, default=10, help="row chunks per tensor (divides 10)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = _write(tmp, args.tensors, args.chunks)
    print(f"torch {torch.__version__}; median of {args.reps}, CPU seconds")
    print("| .metadata | MB | C unpickler alone (before) | pre-scan + C (now) | pre-scan alone | pure-Python |")
    print("|---|---|---|---|---|---|")
    for name, data in files.items():
        ways = {
            "c": lambda: unpickler._DcpUnpickler(io.BytesIO(data), "x").load(),
            "scan_c": lambda: unpickler.unpickle_dcp_metadata(data, "x"),
            "scan": lambda: unpickler._scan_opcodes(data),
            "python": lambda: _PurePythonUnpickler(io.BytesIO(data), "x").load(),
        }
        t = _median_times(ways, args.reps)
        print(f"| {name} | {len(data) / 1e6:.1f} | {t['c']:.2f} | {t['scan_c']:.2f} ({t['scan_c'] / t['c']:.2f}x) "
              f"| {t['scan']:.2f} | {t['python']:.2f} ({t['python'] / t['c']:.2f}x) |")


if __name__ == "__main__":
    main()
