"""One training step (forward + backward + AdamW) of a ``transformers`` causal LM under torch's
FSDP2 and under hp.fully_shard, each applied to every decoder layer and then the root (as
accelerate's FSDP2 plugin wraps a transformers model).

The models are ``transformers``' own Llama and Qwen3 (``AutoModelForCausalLM`` classes, SDPA
attention, through :mod:`hyper_parallel.models.hf_causal_lm` so that a call returns the logits,
as the recipe's ``model=hf`` trains them), from configs written here (no downloads). Per family
both implementations shard copies of one model initialised from seed 0, take two untimed steps
(the losses must agree; step 2 measures the peak RSS), then alternate timed steps in the same
processes, after a warm-up step of each on a one-layer model. See ``benchmarks/README.md``.

    python benchmarks/hf_step.py [--families llama qwen3] [--steps 6] [--layers 4] [--dim 256]
    torchrun --standalone --nproc_per_node=2 benchmarks/hf_step.py
"""

from __future__ import annotations

import argparse
from typing import Any, Dict

import torch
import torch.distributed as dist
import transformers

from hyper_parallel.models import hf_causal_lm

from fsdp_step import (IMPLS, ImplResult, _build_impl, _mesh, _optimizer, _step, run_alternating,
                       _use_mmap_for_large_blocks, _wrap, print_ratios, print_table, step_ratios)
from launch import launch_benchmark

FAMILIES = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", choices=tuple(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--steps", type=int, default=6, help="timed steps per implementation and family")
    parser.add_argument("--chunk", type=int, default=2, help="consecutive steps per turn when alternating")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=256, help="hidden_size")
    parser.add_argument("--ffn", type=int, default=768, help="intermediate_size")
    parser.add_argument("--layers", type=int, default=4, help="num_hidden_layers")
    parser.add_argument("--heads", type=int, default=8, help="num_attention_heads")
    parser.add_argument("--kv-heads", type=int, default=4, help="num_key_value_heads")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--mixed-precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: bf16 params, fp32 reduce")
    # fsdp_step's wrapping options that this benchmark does not vary.
    parser.set_defaults(device="cpu", hsdp=False, float8=False, compile=False)
    return parser.parse_args(argv)


def _config(family: str, args: argparse.Namespace, layers: int) -> Any:
    """The ``transformers`` config of ``family`` at the benchmark's sizes."""
    return FAMILIES[family](vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.ffn,
                            num_hidden_layers=layers, num_attention_heads=args.heads,
                            num_key_value_heads=args.kv_heads, head_dim=args.dim // args.heads,  # Qwen3's default is 128
                            max_position_embeddings=args.seq, tie_word_embeddings=False)


def _model(config: Any) -> torch.nn.Module:
    """``config``'s model on the CPU, initialised by its own ``_init_weights`` from seed 0 (the
    same weights on every rank)."""
    model = hf_causal_lm.build_meta(config)
    model.to_empty(device="cpu")
    model.init_from_seed(0)
    return model


def run(args: argparse.Namespace) -> Dict[str, Dict[str, ImplResult]]:
    """Per family: build, measure and time both implementations on this rank."""
    torch.set_num_threads(1)
    _use_mmap_for_large_blocks()
    mesh = _mesh(args)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1),
                           generator=torch.Generator().manual_seed(1000 + dist.get_rank()))
    out = {}
    for family in args.families:
        for name in IMPLS:  # code, caches and thread pools that the first one measured would pay for alone
            model = _wrap(_model(_config(family, args, layers=1)), name, mesh, args)
            _step(model, _optimizer(model, name, args), tokens)
        reference = _model(_config(family, args, args.layers))
        results = out[family] = {name: ImplResult() for name in IMPLS}
        wrapped = {name: _build_impl(name, reference, mesh, tokens, results[name], args) for name in IMPLS}
        del reference
        run_alternating(wrapped, tokens, results, steps=args.steps, chunk=args.chunk)
        del wrapped
    return out


def _report(args: argparse.Namespace, out: Dict[str, Dict[str, ImplResult]]) -> None:
    world = dist.get_world_size()
    for family, results in out.items():
        config = _config(family, args, args.layers)
        params = sum(p.numel() for p in hf_causal_lm.build_meta(config).parameters())
        print(f"\ntransformers {transformers.__version__} {hf_causal_lm.model_class(config).__name__} "
              f"({params / 1e6:.1f}M params: {args.layers} layers, hidden {args.dim}, heads {args.heads}/"
              f"{args.kv_heads}, vocab {args.vocab}), FSDP {world} gloo ranks, batch {args.batch}/rank x seq "
              f"{args.seq}, {args.mixed_precision}, eager, {len(results['torch'].step_times_s)} timed steps each "
              f"(alternating, chunks of {args.chunk})")
        print_table(results)
        print_ratios(step_ratios(results), results)


def main(argv=None) -> None:
    args = _parse_args(argv)
    launch_benchmark(run, _report, args, 2)


if __name__ == "__main__":
    main()
