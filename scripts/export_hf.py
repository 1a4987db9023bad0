#!/usr/bin/env python
"""Export a training checkpoint's model as Hugging Face safetensors shards (+ index, config.json).

    scripts/export_hf.py CHECKPOINT OUT_DIR [--config RECIPE_CONFIG] [--format transformers|native]
                         [--dtype float32|bfloat16|float16] [--max-shard-bytes N] [--no-tokenizer]

CHECKPOINT is a ``step-N`` directory or a folder of them (the newest is used). The model's
shape comes from the run's resolved config, ``${output_dir}/config.yaml`` next to the
checkpoint folder (or ``--config``).

``--format transformers`` (default): ``transformers`` tensor names and rotary layout, and a
``config.json`` that ``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads: a
``LlamaForCausalLM``, or for a mixture of experts (``model.moe``) a ``Qwen3MoeForCausalLM``
(:mod:`hyper_parallel.models.hf_moe`; what Qwen3-MoE cannot express, such as shared experts or
an expert bias, is refused). ``config.json``'s ``dtype`` is the dtype of the tensors written
(the checkpoint's). ``--format native`` (Llama only): our names, and ``config.json`` holding
the ``LlamaConfig`` fields, so ``Transformer(LlamaConfig(**config))`` (without
``architectures``) rebuilds the model. Either directory works as ``model.init_from``. Runs in a
plain process, no GPU or process group.

A ``model=hf`` run (``model.path=DIR``) exports its checkpoint's tensors under their own
(``transformers``) names with ``DIR``'s ``config.json`` and tokenizer files: a folder
``from_pretrained`` loads as the model ``DIR`` describes, with the trained weights.
``--dtype`` writes the weights (and config.json's ``dtype``) in that dtype (default: the
checkpoint's).

When the run used a ``tokenizer.json`` (``data.tokenizer``, or the sidecar of its token file),
it is copied next to the model with a ``tokenizer_config.json`` (bos = eos = the token that
joined documents), and ``config.json`` gets ``bos_token_id`` / ``eos_token_id``, so
``AutoTokenizer.from_pretrained(OUT_DIR)`` works too; ``--no-tokenizer`` leaves it out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Callable, Optional

import torch

from _checkpoints import resolve_checkpoint
from omegaconf import OmegaConf

from hyper_parallel.checkpoint import DEFAULT_MAX_SHARD_BYTES, CheckpointError, export_hf
from hyper_parallel.core.distributed_checkpoint.hf import Converted
from hyper_parallel.models import hf_causal_lm, hf_llama, hf_moe
from hyper_parallel.models.moe import MoEConfig
from hyper_parallel.trainer.config import typed_config
from hyper_parallel.trainer.config.model import model_config
from hyper_parallel.utils.fileio import write_file_atomically
from hyper_parallel.trainer.checkpointing.hf_tokenizer import run_tokenizer, special_token_ids, write_tokenizer_files


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _default_recipe_config(checkpoint: str) -> Optional[str]:
    output_dir = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint)))
    path = os.path.join(output_dir, "config.yaml")
    return path if os.path.isfile(path) else None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint")
    parser.add_argument("out_dir")
    parser.add_argument("--config", help="the recipe's config.yaml (for config.json)")
    parser.add_argument("--format", choices=("transformers", "native"), default="transformers")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="the weights' dtype (default: the checkpoint's)")
    parser.add_argument("--max-shard-bytes", type=int, default=DEFAULT_MAX_SHARD_BYTES)
    parser.add_argument("--no-tokenizer", action="store_true", help="do not copy the run's tokenizer")
    args = parser.parse_args(argv)
    try:
        checkpoint = resolve_checkpoint(args.checkpoint)
        config_path = args.config or _default_recipe_config(checkpoint)
        if args.format == "transformers" and not config_path:
            raise ValueError(f"no config.yaml next to {checkpoint}: pass the run's config with --config "
                             "(the transformers layout needs the model's shape), or use --format native")
        run_cfg = OmegaConf.load(config_path) if config_path else None
        dtype = DTYPES[args.dtype] if args.dtype else None
        if run_cfg is not None and run_cfg.model.get("path"):
            return _export_hf_model(checkpoint, os.path.expanduser(str(run_cfg.model.path)), args, dtype)
        cfg = model_config(typed_config(run_cfg).model) if run_cfg is not None else None
        layout = hf_moe if isinstance(cfg, MoEConfig) else hf_llama
        if isinstance(cfg, MoEConfig) and args.format == "native":
            raise ValueError("--format native covers the Llama model only: export a mixture of experts with "
                             "--format transformers (transformers' Qwen3-MoE)")
        if args.format == "transformers":
            # refuses what it cannot express
            config = layout.hf_config(cfg, dtype or hf_llama.exported_dtype(checkpoint))
        tokenizer = None
        if run_cfg is not None and not args.no_tokenizer:
            try:
                tokenizer = run_tokenizer(run_cfg)
            except (ValueError, OSError) as err:
                raise ValueError(f"the run's tokenizer: {err} (pass --no-tokenizer to export without it)") from None
        convert = (lambda name, tensor: layout.to_hf(name, tensor, cfg)) if args.format == "transformers" else None
        if dtype is not None:
            convert = _casting(convert, dtype)
        index = export_hf(checkpoint, args.out_dir, max_shard_bytes=args.max_shard_bytes, convert=convert)
        if tokenizer is not None:
            write_tokenizer_files(tokenizer, args.out_dir, max_length=cfg.max_seq_len)
    except (CheckpointError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if cfg is not None:
        if args.format == "transformers":
            config.update(special_token_ids(tokenizer) if tokenizer is not None else {})
        else:
            config = {"architectures": [hf_llama.NATIVE_ARCHITECTURE], **dataclasses.asdict(cfg)}
        write_file_atomically(os.path.join(args.out_dir, "config.json"), json.dumps(config, indent=2).encode())
    print(f"exported {len(index['weight_map'])} tensors ({index['metadata']['total_size']:,} bytes) "
          f"from {checkpoint} to {args.out_dir}" + (" with config.json" if config_path else "")
          + (f" and the tokenizer {tokenizer.path}" if tokenizer is not None else ""))
    return 0


def _casting(convert: Optional[Callable[[str, torch.Tensor], Converted]],
             dtype: torch.dtype) -> Callable[[str, torch.Tensor], Converted]:
    """``convert`` (None: keep the name) with every tensor it returns cast to ``dtype``."""
    def cast(name: str, tensor: torch.Tensor) -> Converted:
        out = (name, tensor) if convert is None else convert(name, tensor)
        if out is None:
            return None
        if isinstance(out, tuple):
            return out[0], out[1].to(dtype)
        return {key: value.to(dtype) for key, value in out.items()}
    return cast


def _export_hf_model(checkpoint: str, path: str, args: argparse.Namespace, dtype: Optional[torch.dtype]) -> int:
    """A ``model=hf`` run: its tensors as they are named, ``path``'s config.json (in the weights'
    dtype) and tokenizer files."""
    if args.format == "native":
        print("error: --format native is for the project's Llama: a model=hf run exports in the transformers "
              "layout (the default)", file=sys.stderr)
        return 1
    try:
        dtype = dtype or hf_llama.exported_dtype(checkpoint)
        config = hf_causal_lm.export_config(path, dtype)
        index = export_hf(checkpoint, args.out_dir, max_shard_bytes=args.max_shard_bytes, convert=_casting(None, dtype))
        copied = [] if args.no_tokenizer else hf_causal_lm.copy_tokenizer_files(path, args.out_dir)
    except (CheckpointError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    write_file_atomically(os.path.join(args.out_dir, "config.json"), json.dumps(config, indent=2).encode())
    print(f"exported {len(index['weight_map'])} tensors ({index['metadata']['total_size']:,} bytes) "
          f"from {checkpoint} to {args.out_dir} with {path}'s config.json"
          + (f" and {', '.join(copied)}" if copied else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
