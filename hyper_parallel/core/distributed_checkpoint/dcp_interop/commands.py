"""The ``import-dcp`` and ``export-dcp`` subcommands of ``python -m hyper_parallel.checkpoint``."""

from __future__ import annotations

import argparse
import math

from hyper_parallel.core.distributed_checkpoint.dcp_interop.convert import export_dcp, import_dcp
from hyper_parallel.core.distributed_checkpoint.dcp_interop.fused_split import FusedSplit
from hyper_parallel.core.distributed_checkpoint.dcp_interop.key_mapping import RenameRule
from hyper_parallel.core.distributed_checkpoint.dcp_interop.reader import is_dcp_checkpoint
from hyper_parallel.core.distributed_checkpoint.dcp_interop.rotary_layout import RotateHalf
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.metadata import TensorStorageMetadata


__all__ = ["add_dcp_commands", "run_dcp_command"]


def _rename_rule(text: str) -> RenameRule:
    try:
        return RenameRule.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fused_split(text: str) -> FusedSplit:
    try:
        return FusedSplit.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _rotate_half(text: str) -> RotateHalf:
    try:
        return RotateHalf.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_dcp_commands(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("import-dcp", help="convert a torch DCP (e.g. torchtitan) checkpoint into ours, "
                                          "chunk by chunk; never unpickles anything but DCP's metadata classes")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--rename", action="append", default=[], type=_rename_rule, metavar="OLD=NEW",
                   help="replace key prefix OLD by NEW (the first matching rule applies; '=model.' prefixes "
                        "every key; '*' matches one dotted component, each '*' of NEW is what its "
                        "counterpart in OLD matched: 'layers.*.attention.qkv_linear.=model.layers.*.attention.')")
    p.add_argument("--exclude", action="append", default=[], metavar="PREFIX",
                   help="leave out keys starting with PREFIX ('*': one dotted component; applied first)")
    p.add_argument("--split-fused", action="append", default=[], type=_fused_split,
                   metavar="FUSED=Q,K,V:N_HEADS:N_KV_HEADS[:grouped|concat]",
                   help="cut keys with the component FUSED (a fused attention projection and its optimizer "
                        "state) into Q, K, V along dim 0; layout 'grouped' (torchtitan's fused wqkv, the "
                        "default) or 'concat' ([q;k;v]); applied before --rename")
    p.add_argument("--rotate-half", action="append", default=[], type=_rotate_half, metavar="NAME:N_HEADS",
                   help="tensors of keys with the component NAME (and their optimizer moments) hold N_HEADS heads "
                        "of rotate-half rotary rows (torchtitan's Qwen3: wq, wk, q_norm:1, k_norm:1); their rows "
                        "are moved to our interleaved pairs, per head; applied after --split-fused")
    p.add_argument("--force", action="store_true", help="replace DST if it is a checkpoint of ours")
    p = sub.add_parser("export-dcp", help="write a checkpoint as a torch DCP checkpoint (torch.distributed."
                                          "checkpoint.load reads it)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--force", action="store_true", help="replace DST if it is a torch DCP checkpoint")


def run_dcp_command(args: argparse.Namespace) -> bool:
    """Run ``args.command`` if it is one of ours; False if it is not.

    Raises:
        CheckpointError: ``inspect``/``verify`` of a torch DCP directory (it has no checksums
            to verify; ``import-dcp`` makes a checkpoint that has them).
        DestinationRefused: ``import-dcp``/``export-dcp`` onto their source or a folder that
            is not empty (the CLI exits 2).
    """
    if args.command in ("inspect", "verify") and is_dcp_checkpoint(args.dir):
        raise CheckpointError(f"{args.dir} is a torch DCP checkpoint, which has no checksums to verify and no "
                              f"metadata.json to inspect: `import-dcp {args.dir} DST` converts it into one that has")
    if args.command == "import-dcp":
        metadata = import_dcp(args.src, args.dst, rename=args.rename, exclude=args.exclude,
                              split=args.split_fused, rotate_half=args.rotate_half, force=args.force)
        tensors = [md for md in metadata.state_dict_metadata.values() if isinstance(md, TensorStorageMetadata)]
        nbytes = sum(math.prod(md.size) * md.dtype.itemsize for md in tensors)
        print(f"imported {len(tensors)} tensors ({nbytes} bytes) and "
              f"{len(metadata.state_dict_metadata) - len(tensors)} values from {args.src} into {args.dst}")
        return True
    if args.command == "export-dcp":
        count = export_dcp(args.src, args.dst, force=args.force)
        print(f"exported {count} entries of {args.src} as a torch DCP checkpoint to {args.dst}")
        return True
    return False
