#!/usr/bin/env python
"""Export a training checkpoint's model as HF-style safetensors shards (+ index.json, config.json).

    scripts/export_hf.py CHECKPOINT OUT_DIR [--config RECIPE_CONFIG] [--max-shard-bytes N]

CHECKPOINT is a ``step-N`` directory or a folder of them (the newest is used). The recipe
writes its resolved config to ``${output_dir}/config.yaml``; with ``--config`` (default: that
file next to the checkpoint folder, if present) the model's ``LlamaConfig`` is written to
``OUT_DIR/config.json``, so ``Transformer(LlamaConfig(**config))`` rebuilds the model.
Runs in a plain process, no GPU or process group needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Optional

from _checkpoints import resolve_checkpoint
from omegaconf import OmegaConf

from hyper_parallel.checkpoint import CheckpointError, export_hf
from hyper_parallel.core.distributed_checkpoint.hf import DEFAULT_MAX_SHARD_BYTES
from hyper_parallel.trainer.config import llama_config


def _default_recipe_config(checkpoint: str) -> Optional[str]:
    output_dir = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint)))
    path = os.path.join(output_dir, "config.yaml")
    return path if os.path.isfile(path) else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("out_dir")
    parser.add_argument("--config", help="the recipe's config.yaml (for config.json)")
    parser.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    args = parser.parse_args(argv)
    try:
        checkpoint = resolve_checkpoint(args.checkpoint)
        index = export_hf(checkpoint, args.out_dir, max_shard_bytes=args.max_shard_bytes)
    except (CheckpointError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    config_path = args.config or _default_recipe_config(checkpoint)
    if config_path:
        model = dataclasses.asdict(llama_config(OmegaConf.load(config_path).model))
        with open(os.path.join(args.out_dir, "config.json"), "w") as f:
            json.dump({"architectures": ["hyper_parallel.models.llama.Transformer"], **model}, f, indent=2)
    print(f"exported {len(index['weight_map'])} tensors ({index['metadata']['total_size']:,} bytes) "
          f"from {checkpoint} to {args.out_dir}" + (" with config.json" if config_path else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
