"""``python -m hyper_parallel.checkpoint inspect|verify|list|export-hf|import-dcp|export-dcp DIR ...``

Every command also takes fsspec URLs (``s3://bucket/run``, ``memory://``) for its checkpoints; the
requests of ``inspect``, ``verify`` and ``list`` are bounded (``store.STARTUP_BOUNDS``), and a store
that does not answer is one line, exit code 2."""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from typing import Any, Dict, List, Optional, TextIO, Tuple

from hyper_parallel.core.distributed_checkpoint import api
from hyper_parallel.core.distributed_checkpoint.dcp_interop.commands import add_dcp_commands, run_dcp_command
from hyper_parallel.core.distributed_checkpoint.dcp_interop.destination import DestinationRefused
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.hf import DEFAULT_MAX_SHARD_BYTES, export_hf
from hyper_parallel.core.distributed_checkpoint.manager import committed_steps, resolve_checkpoint
from hyper_parallel.core.distributed_checkpoint.storage import checkpoint_step
from hyper_parallel.core.distributed_checkpoint.object_store import store
from hyper_parallel.core.distributed_checkpoint.format.metadata import (
    FORMAT_NAME,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
    dtype_name,
)
from hyper_parallel.utils.units import format_bytes



def _layout(metadata: Metadata, fqn: str) -> str:
    layout = metadata.layouts.get(fqn)
    if not layout:
        return "-"
    names = layout.get("mesh_dim_names")
    mesh = "x".join(str(s) for s in layout.get("mesh_shape", []))
    placements = ",".join(str(p) for p in layout.get("placements", []))
    dims = f" ({','.join(names)})" if names else ""
    return f"mesh {mesh}{dims} placements [{placements}]"


def _checkpoint(given: str) -> Tuple[str, str]:
    """The checkpoint ``given`` names (itself, or a manager folder's newest ``step-N``) and
    how to show it: its path, saying which step of the folder it is."""
    path = resolve_checkpoint(given)
    if path == given:
        return path, path
    return path, f"{path} (the newest committed step in {given})"


# The recipe's ``parallel`` entry: the degrees of the mesh a checkpoint was saved on.
MESH_DEGREES = ("pp", "dp_replicate", "dp_shard", "tp")


def _mesh(values: Dict[str, Any]) -> str:
    """The saving mesh's degrees from the ``parallel.*`` values, or why they are unknown."""
    degrees = [(name, values.get(f"parallel.{name}")) for name in MESH_DEGREES]
    if any(value is None for _, value in degrees):
        return "not recorded (no 'parallel' entry; each tensor's layout is listed below)"
    return " x ".join(f"{name}={value}" for name, value in degrees)


def inspect(directory: str, out: TextIO) -> None:
    """Print what a checkpoint holds: step, format, the mesh it was saved on, layouts at save
    time, tensors and sizes. ``directory`` may be a folder of ``step-N`` checkpoints: its newest
    is shown."""
    directory, shown = _checkpoint(directory)
    metadata = api.read_checkpoint_metadata(directory)
    step = checkpoint_step(directory)
    tensors = {k: md for k, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    values = sorted(k for k in metadata.state_dict_metadata if k not in tensors)
    # Values are small JSON (or pickled, shown as such: the CLI never unpickles).
    pickled = {k for k in values if metadata.storage_data[MetadataIndex(k)].encoding == "pickle"}
    loaded: Dict[str, Any] = {k: None for k in values if k not in pickled}
    if loaded:
        api.load(loaded, checkpoint_id=directory, no_dist=True)
    print(f"checkpoint: {shown}", file=out)
    print(f"step: {step if step is not None else 'unknown'}", file=out)
    print(f"format: {FORMAT_NAME} version {metadata.version}, saved by {metadata.world_size} rank(s), "
          f"save id {metadata.save_id or '-'}", file=out)
    print(f"mesh: {_mesh(loaded)}", file=out)
    total = 0
    print(f"tensors ({len(tensors)}):", file=out)
    width = max((len(k) for k in tensors), default=0)
    for fqn in sorted(tensors):
        md = tensors[fqn]
        nbytes = math.prod(md.size) * md.dtype.itemsize
        total += nbytes
        shape = "x".join(str(s) for s in md.size) or "scalar"
        print(f"  {fqn:<{width}}  {dtype_name(md.dtype):<9} {shape:<16} {format_bytes(nbytes, digits=2, sep=' '):>11}  "
              f"{len(md.chunks)} chunk(s)  {_layout(metadata, fqn)}", file=out)
    print(f"values ({len(values)}):{'' if values else ' -'}", file=out)
    for key in values:
        text = "<pickled>" if key in pickled else repr(loaded[key])
        print(f"  {key} = {text if len(text) <= 120 else text[:117] + '...'}", file=out)
    file_bytes = sum(f.size for f in metadata.files.values())
    print(f"total tensor bytes: {total} ({format_bytes(total, digits=2, sep=' ')}); {len(metadata.files)} data file(s), "
          f"{file_bytes} bytes on disk", file=out)


def list_steps(folder: str, out: TextIO) -> None:
    """Print the committed ``step-N`` checkpoints of a manager folder, oldest first."""
    steps = committed_steps(folder)
    if not steps:
        raise CheckpointError(f"{folder} holds no committed step-N checkpoint")
    for step in steps:
        print(f"step-{step}", file=out)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hyper_parallel.checkpoint",
                                     description="Inspect, verify and export hyper_parallel checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="list tensors, shapes, dtypes, sizes and save-time layouts")
    p.add_argument("dir", help="a checkpoint, or a folder of step-N checkpoints (its newest)")
    p = sub.add_parser("verify", help="check every byte of every data file against its checksum")
    p.add_argument("dir", help="a checkpoint, or a folder of step-N checkpoints (its newest)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="accept pickled values (checksummed, never unpickled) as load with allow_pickle=True does")
    p = sub.add_parser("list", help="the committed step-N checkpoints of a folder, oldest first")
    p.add_argument("dir", help="a folder of step-N checkpoints (a directory or an fsspec URL)")
    p = sub.add_parser("export-hf", help="write HF-style safetensors shards + model.safetensors.index.json")
    p.add_argument("dir")
    p.add_argument("out")
    p.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    add_dcp_commands(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run the CLI; returns the exit code (1 on a bad or corrupt checkpoint, 2 on a refused
    destination, when an object store does not answer or its client fails, e.g. without
    credentials)."""
    args = _parser().parse_args(argv)
    with store.bounded_requests(store.STARTUP_BOUNDS):
        return _run(args)


def _location(args: argparse.Namespace) -> str:
    """What the command reads."""
    return args.dir if "dir" in args else args.src


def _run(args: argparse.Namespace) -> int:
    try:
        if run_dcp_command(args):
            pass
        elif args.command == "inspect":
            inspect(args.dir, sys.stdout)
        elif args.command == "verify":
            directory, shown = _checkpoint(args.dir)
            metadata = api.verify_checkpoint(directory, allow_pickle=args.allow_pickle)
            total = sum(f.size for f in metadata.files.values())
            print(f"OK: {shown}: {len(metadata.files)} file(s), {total} bytes match their checksums")
        elif args.command == "list":
            list_steps(args.dir, sys.stdout)
        else:
            index = export_hf(_checkpoint(args.dir)[0], args.out, max_shard_bytes=args.max_shard_bytes)
            files = sorted(set(index["weight_map"].values()))
            print(f"exported {len(index['weight_map'])} tensors ({index['metadata']['total_size']} bytes) "
                  f"to {args.out} in {len(files)} file(s)")
    except BrokenPipeError:
        # The reader went away (``inspect DIR | head``): stop quietly, as unix tools do. What
        # is still buffered for stdout goes to /dev/null, or its flush at exit fails again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    except DestinationRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except store.unreachable_errors() as exc:  # before OSError: some of them are OSErrors
        print(f"error: {store.unreachable_message(_location(args), exc)}", file=sys.stderr)
        return 2
    except store.client_errors() as exc:
        print(f"error: {store.client_message(_location(args), exc)}", file=sys.stderr)
        return 2
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
