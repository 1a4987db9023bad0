"""One training step on a (data-parallel x tensor-parallel) mesh: torch's composition vs ours.

Both apply the same tensor-parallel plan (``hyper_parallel.models.llama_parallel.apply_tensor_parallel``,
i.e. torch's ``parallelize_module`` with the Megatron-style plan and sequence parallelism) to
their own deep copy of one Llama model built from seed 0, then shard every block and the root
over the data-parallel sub-mesh: torch's ``fully_shard`` (FSDP2) for "torch", ``hp.fully_shard``
for "ours". The TP half is identical by construction; the figures compare the FSDP halves on a
2-D mesh. The loss is the vocabulary-parallel ``cross_entropy`` under ``loss_parallel``.

    python benchmarks/nd_step.py --model llama_debug     # spawns 4 gloo ranks: (shard 2, tp 2)
    torchrun --standalone --nproc_per_node=4 benchmarks/nd_step.py [--tp 2]
    torchrun --standalone --nproc_per_node=$NGPU benchmarks/nd_step.py --device cuda

Timing and memory are measured as in ``fsdp_step.py`` (whose helpers this imports; see
``benchmarks/README.md``): implementations alternate in chunks, median of the slowest rank's
step, peak RSS during step 2 over the RSS before the model copy. ``--device cuda`` runs the same
code on nccl with the allocator's peak instead of RSS; it was not run (no GPU on the machine
that wrote it).

``--pp 2`` measures pipeline parallelism x FSDP instead (mesh (pp, shard), no TP): both split the
model with ``hyper_parallel.models.llama_parallel.split_stage`` and run torch's schedule (``--schedule``,
``--microbatches``) from ``build_schedule``; "torch" wraps each stage in torch's ``fully_shard``
and torch's ``PipelineStage``, "ours" in ``hp.fully_shard`` and ``ShardedPipelineStage``.

    python benchmarks/nd_step.py --pp 2 --layers 4       # 4 gloo ranks: (pp 2, shard 2)
"""

from __future__ import annotations

import argparse
import copy
import gc
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.pipelining import PipelineStage

import hyper_parallel as hp
from hyper_parallel.models import build_llama
from hyper_parallel.models.llama import CONFIGS
from hyper_parallel.models.llama_parallel import apply_tensor_parallel, split_stage
from hyper_parallel.parallel.pipeline import (SCHEDULES, ShardedPipelineStage, build_schedule, stage_indices,
                                              stage_layers, stages_per_rank)
from hyper_parallel.parallel.tensor import cross_entropy, loss_parallel
from hyper_parallel.platform import get_platform
from hyper_parallel.trainer.setup.parallelize import dp_mesh

from fsdp_step import (IMPLS, ImplResult, _over_ranks, _reset_peak_rss, _rss_bytes, _timed_step,
                       _trimmed_rss_bytes, _use_mmap_for_large_blocks, print_ratios, print_table,
                       step_ratios, write_json)
from launch import launch_benchmark

_SHARD_FNS = {"torch": lambda: torch_fully_shard, "ours": lambda: hp.fully_shard}


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, help="tensor-parallel degree (the rest is data-parallel; default 2, "
                                               "1 with --pp)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline degree: > 1 measures PP x FSDP (no TP)")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="1F1B", help="pipeline schedule (--pp)")
    parser.add_argument("--microbatches", type=int, default=4, help="pipeline microbatches per step (--pp)")
    parser.add_argument("--world", type=int, default=4, help="ranks to spawn on CPU (without torchrun)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per implementation")
    parser.add_argument("--chunk", type=int, default=2, help="consecutive steps per turn when alternating")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", help="default llama_debug on cpu, llama_1b on cuda (heads, kv-heads, "
                                        "vocab and seq must divide by --tp)")
    parser.add_argument("--layers", type=int, help="override the model's number of blocks")
    parser.add_argument("--dim", type=int, help="override the model's width (must divide by its heads)")
    parser.add_argument("--batch", type=int, help="sequences per data-parallel rank (default 2 on cpu, 4 on cuda; "
                                                  "--microbatches with --pp)")
    parser.add_argument("--seq", type=int, help="sequence length (default 128 on cpu, 2048 on cuda)")
    parser.add_argument("--json", help="also write the results to this file (rank 0)")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    pp = args.pp > 1
    for key, value in dict(model="llama_1b" if cuda else "llama_debug",
                           batch=args.microbatches if pp else 4 if cuda else 2,
                           seq=2048 if cuda else 128, tp=1 if pp else 2).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _overrides(args: argparse.Namespace) -> dict:
    return {key: value for key, value in (("n_layers", args.layers), ("dim", args.dim)) if value is not None}


def _mesh(args: argparse.Namespace):
    world = dist.get_world_size()
    if args.pp > 1:
        if args.tp != 1 or world % args.pp:
            raise SystemExit(f"--pp {args.pp} needs --tp 1 and must divide the world size {world}")
        return hp.init_device_mesh(args.device, (args.pp, world // args.pp), mesh_dim_names=("pp", "shard"))
    if args.tp < 2 or world % args.tp:
        raise SystemExit(f"--tp {args.tp} must be >= 2 and divide the world size {world}")
    return hp.init_device_mesh(args.device, (world // args.tp, args.tp), mesh_dim_names=("shard", "tp"))


@dataclass
class _Pipeline:
    """This rank's stages of one implementation and the schedule running them."""

    parts: List[torch.nn.Module]
    schedule: object
    first: bool
    last: bool
    pp: int

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return (p for part in self.parts for p in part.parameters())


def _wrap(model: torch.nn.Module, name: str, mesh, args: Optional[argparse.Namespace] = None):
    """The shared TP plan over ``mesh["tp"]``, then ``name``'s fully_shard over the dp sub-mesh
    (with ``--pp``: this rank's stages, each sharded by ``name``, in a schedule)."""
    if "pp" in mesh.mesh_dim_names:
        return _wrap_pipeline(model, name, mesh, args)
    apply_tensor_parallel(model, mesh["tp"])
    shard_fn = _SHARD_FNS[name]()
    for block in model.layers.values():
        shard_fn(block, mesh=dp_mesh(mesh))
    shard_fn(model, mesh=dp_mesh(mesh))
    return model


def _wrap_pipeline(model: torch.nn.Module, name: str, mesh, args: argparse.Namespace) -> _Pipeline:
    pp, pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
    ranges = stage_layers(len(model.layers), pp * stages_per_rank(args.schedule))
    shard_fn, stage_cls = _SHARD_FNS[name](), PipelineStage if name == "torch" else ShardedPipelineStage
    parts, stages = [], []
    for index in stage_indices(pp_rank, pp, args.schedule):
        part = split_stage(model, ranges[index], first=index == 0, last=index == len(ranges) - 1)
        for block in part.layers.values():
            shard_fn(block, mesh=mesh["shard"])
        shard_fn(part, mesh=mesh["shard"])
        parts.append(part)
        stages.append(stage_cls(part, index, len(ranges), get_platform().current_device(),
                                group=mesh["pp"].get_group()))
    schedule = build_schedule(stages, args.schedule, args.microbatches, cross_entropy)
    return _Pipeline(parts, schedule, stages[0].is_first, stages[-1].is_last, pp)


def _step(model, optimizer, tokens: torch.Tensor) -> float:
    if isinstance(model, _Pipeline):
        loss = _pipeline_step(model, tokens)
    else:
        with loss_parallel():
            loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
        loss = loss.item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def _pipeline_step(pipeline: _Pipeline, tokens: torch.Tensor) -> float:
    """One schedule step; the batch loss times ``pp`` on the last stage, 0 elsewhere, so that
    the average over all ranks is the average over the data-parallel ranks."""
    losses: list = []
    inputs = (tokens[:, :-1],) if pipeline.first else ()
    pipeline.schedule.step(*inputs, target=tokens[:, 1:] if pipeline.last else None, losses=losses)
    return sum(loss.item() for loss in losses) * pipeline.pp if pipeline.last else 0.0


def _peak_reset() -> None:
    platform = get_platform()
    platform.reset_peak_memory() if platform.is_accelerator else _reset_peak_rss()


def _memory(before: int, peak: bool) -> int:
    """Since ``before``: the peak (allocator's or RSS's) or the current use, max over ranks."""
    platform = get_platform()
    if platform.is_accelerator:
        now = platform.peak_memory_bytes() if peak else platform.device_module.memory_allocated()
    else:
        now = _rss_bytes("VmHWM" if peak else "VmRSS")
    return int(_over_ranks(now - before))


def _build_impl(name: str, reference: torch.nn.Module, mesh, tokens, result: ImplResult, args: argparse.Namespace):
    """Copy + TP + fully_shard + steps 1 and 2, measuring memory growth as fsdp_step does."""
    platform = get_platform()
    gc.collect()
    before = platform.device_module.memory_allocated() if platform.is_accelerator else _trimmed_rss_bytes()
    model = _wrap(copy.deepcopy(reference), name, mesh, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result.losses.append(_over_ranks(_step(model, optimizer, tokens), dist.ReduceOp.AVG))
    gc.collect()
    _peak_reset()
    result.losses.append(_over_ranks(_step(model, optimizer, tokens), dist.ReduceOp.AVG))
    result.peak_step_bytes = _memory(before, peak=True)
    gc.collect()
    result.resident_bytes = _memory(before, peak=False)
    return model, optimizer


def run(args: argparse.Namespace) -> Dict[str, ImplResult]:
    """Build, measure and time both compositions on this rank."""
    platform = get_platform()
    if not platform.is_accelerator:
        torch.set_num_threads(1)
        _use_mmap_for_large_blocks()
    mesh = _mesh(args)
    device = platform.current_device()
    vocab = CONFIGS[args.model]["vocab_size"]
    # The ranks of one TP group take the same batch (the plan replicates the input tokens).
    dp_rank = mesh["shard"].get_local_rank()  # (and every pipeline rank of one replica)
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1),
                           generator=torch.Generator().manual_seed(1000 + dp_rank)).to(device)
    torch.manual_seed(0)
    reference = build_llama(args.model, max_seq_len=args.seq, **_overrides(args)).to(device)
    for name in IMPLS:  # warm-up on one block (per stage): first-use costs are paid by neither measurement
        stages = args.pp * stages_per_rank(args.schedule) if args.pp > 1 else 1
        one_block = build_llama(args.model, max_seq_len=args.seq, **{**_overrides(args), "n_layers": stages})
        model = _wrap(one_block.to(device), name, mesh, args)
        _step(model, torch.optim.AdamW(model.parameters(), lr=1e-3), tokens)
    del model
    results = {name: ImplResult() for name in IMPLS}
    wrapped = {name: _build_impl(name, reference, mesh, tokens, results[name], args) for name in IMPLS}
    del reference
    for r in range(-(-args.steps // args.chunk)):
        for name in (IMPLS if r % 2 == 0 else IMPLS[::-1]):  # alternate who goes first
            for _ in range(min(args.chunk, args.steps - len(results[name].step_times_s))):
                _timed_step(*wrapped[name], tokens, results[name], step=_step)
    return results


def _report(args: argparse.Namespace, results: Dict[str, ImplResult]) -> None:
    torch_r, world = results["torch"], dist.get_world_size()
    blocks = "".join(f", {k} {v}" for k, v in _overrides(args).items())
    layout = (f"pp {args.pp} x shard {world // args.pp}, {args.schedule}, {args.microbatches} microbatches"
              if args.pp > 1 else f"shard {world // args.tp} x tp {args.tp}")
    print(f"\n{args.model}{blocks}, ({layout}) {get_platform().backend} ranks, "
          f"batch {args.batch}/dp rank x seq {args.seq}, fp32, {len(torch_r.step_times_s)} timed steps each "
          f"(alternating, chunks of {args.chunk})")
    print_table(results)
    ratios = step_ratios(results)
    write_json(args, ratios, print_ratios(ratios, results), results)


def main(argv=None) -> None:
    args = _parse_args(argv)
    launch_benchmark(run, _report, args, args.world)


if __name__ == "__main__":
    main()
