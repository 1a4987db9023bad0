"""One training step (forward + backward + AdamW) under torch's FSDP2 and under hp.fully_shard.

Both wrap the same Llama-style decoder (each block, then the root) from identical weights and
are timed alternately in the same processes, so machine load hits both alike. See
``benchmarks/README.md`` for what is measured and how.

    torchrun --standalone --nproc_per_node=2 benchmarks/fsdp_step.py [--steps N] [--json out.json]
    torchrun --standalone --nproc_per_node=4 benchmarks/fsdp_step.py --hsdp
    python benchmarks/fsdp_step.py [--hsdp]       # spawns the ranks itself (2, or 4 with --hsdp)
    torchrun --standalone --nproc_per_node=$NGPU benchmarks/fsdp_step.py --device cuda [--compile]
    python benchmarks/fsdp_step.py --float8        # torchao float8 linears (pip install hyper_parallel[float8])

With ``--float8`` both wrap the same torchao float8 model (tensorwise); ours all-gathers the
float8 weights as bytes and precomputes their scales after the optimizer step, torch's gathers
them in full precision (its float8 all-gather cannot run on gloo). The all-gather bytes each
rank puts in during one step are reported per dtype.

On an accelerator (``--device cuda``) the implementations run one after the other in the same
processes (``--separate``), each built from the same seed on the meta device, bf16 mixed
precision by default, with the allocator's peak statistics.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from collections import Counter
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecision
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.profiler import ProfilerActivity, profile

import hyper_parallel as hp
from hyper_parallel.models import build_llama
from hyper_parallel.models.llama import CONFIGS
from hyper_parallel.platform import get_platform
from hyper_parallel.models.float8 import convert_to_float8, precompute_scales

from launch import launch_benchmark

IMPLS = ("torch", "ours")
_SHARD_FNS = {"torch": lambda: torch_fully_shard, "ours": lambda: hp.fully_shard}
_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


@dataclass
class ImplResult:
    step_times_s: List[float] = field(default_factory=list)  # slowest rank's time per step
    cpu_times_s: List[float] = field(default_factory=list)  # largest per-rank process CPU time per step
    peak_step_bytes: int = 0  # max over ranks, see _build_impl
    resident_bytes: int = 0  # max over ranks, held between steps
    losses: List[float] = field(default_factory=list)  # global-batch loss at steps 1 and 2
    peak_reserved_bytes: int = 0  # --separate on an accelerator: the allocator's peak reserved
    all_gather_bytes: Dict[str, int] = field(default_factory=dict)  # rank 0, one step, by dtype

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_times_s)

    @property
    def median_cpu_s(self) -> float:
        return statistics.median(self.cpu_times_s)


def _parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hsdp", action="store_true", help="2x2 (replicate, shard) mesh on 4 ranks")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per implementation")
    parser.add_argument("--chunk", type=int, default=2, help="consecutive steps per turn when alternating")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo ranks; cuda: one rank per visible GPU (nccl)")
    parser.add_argument("--separate", action="store_true",
                        help="run the implementations one after the other (default on cuda), "
                             "each built on meta and initialised from the same seed")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each block before sharding (the torchtitan order)")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--mixed-precision", choices=("fp32", "bf16"),
                        help="bf16: bf16 params, fp32 reduce (default on cuda); fp32 (default on cpu)")
    parser.add_argument("--model", help="default llama_50m on cpu, llama_1b on cuda")
    parser.add_argument("--layers", type=int, help="override the model's number of blocks (groups)")
    parser.add_argument("--batch", type=int, help="sequences per rank (default 2 on cpu, 4 on cuda)")
    parser.add_argument("--seq", type=int, help="default 256 on cpu, 2048 on cuda")
    parser.add_argument("--float8", action="store_true",
                        help="torchao float8 linears (tensorwise); ours gathers them in float8")
    parser.add_argument("--json", help="also write the results to this file (rank 0)")
    parser.add_argument("--profile", action="store_true",
                        help="print rank 0's torch.profiler op table for one extra step of each")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    defaults = dict(model="llama_1b" if cuda else "llama_50m", batch=4 if cuda else 2,
                    seq=2048 if cuda else 256, mixed_precision="bf16" if cuda else "fp32")
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.separate = args.separate or cuda
    return args


def _layer_override(args: argparse.Namespace) -> dict:
    return {} if args.layers is None else {"n_layers": args.layers}


def _mp_policy(name: str, args: argparse.Namespace):
    if args.mixed_precision == "fp32":
        return None
    cls = TorchMixedPrecision if name == "torch" else hp.MixedPrecisionPolicy
    return cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _wrap(model: torch.nn.Module, name: str, mesh, args: argparse.Namespace) -> torch.nn.Module:
    """(Convert to float8,) (compile and) shard every block, then the root, with ``name``'s
    fully_shard."""
    if args.float8:
        convert_to_float8(model, "tensorwise", float8_all_gather=name == "ours")
    shard_fn = _SHARD_FNS[name]()
    policy = _mp_policy(name, args)
    kw = {} if policy is None else {"mp_policy": policy}
    for block in model.layers.values():
        if args.compile:
            block.compile(backend=args.compile_backend)
        shard_fn(block, mesh=mesh, **kw)
    shard_fn(model, mesh=mesh, **kw)
    return model


def _optimizer(model: torch.nn.Module, name: str, args: argparse.Namespace) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if args.float8 and name == "ours":  # one all-reduce for all float8 scales per step
        optimizer.register_step_post_hook(lambda *_: precompute_scales(model))
    return optimizer


@contextmanager
def _counted_all_gathers() -> Iterator[Counter]:
    """Bytes this rank passes into all-gathers (torch's FSDP2 and ours both call
    ``dist.all_gather_single``) inside the block, by dtype."""
    counts, original = Counter(), dist.all_gather_single

    def counting(output, input, *args, **kwargs):
        counts[str(input.dtype).replace("torch.", "")] += input.numel() * input.element_size()
        return original(output, input, *args, **kwargs)
    dist.all_gather_single = counting
    try:
        yield counts
    finally:
        dist.all_gather_single = original


def _step(model, optimizer, tokens: torch.Tensor) -> float:
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def _use_mmap_for_large_blocks() -> None:
    """Make glibc return every freed block of >= 64 KiB to the OS, so RSS follows live tensors.

    Without this, glibc raises its mmap threshold after the first large frees and keeps later
    freed tensors in its heap, where they still count as resident.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError as err:
        raise SystemExit(f"the memory measurement needs glibc (Linux): {err}") from err
    if libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024) != 1:
        raise SystemExit("mallopt(M_MMAP_THRESHOLD) failed; RSS would not follow freed tensors")


def _trimmed_rss_bytes() -> int:
    """``VmRSS`` after glibc returned its free heap pages to the OS (``malloc_trim``): a
    baseline that does not depend on how much freed memory earlier work left in the heap for
    the next allocations to reuse (which favoured whichever implementation was built first)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return _rss_bytes("VmRSS")


def _rss_bytes(field_name: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (peak resident since the last reset) of this process."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # sets VmHWM to the current VmRSS


def _over_ranks(value: float, op=dist.ReduceOp.MAX) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.item()


def _warm_up(args, mesh, tokens) -> None:
    """One step of each implementation on a one-block model of the same shapes.

    Loads code, fills caches and thread pools that the first measured implementation would
    otherwise pay for alone.
    """
    for name in IMPLS:
        model = _wrap(build_llama(args.model, n_layers=1, max_seq_len=args.seq), name, mesh, args)
        _step(model, _optimizer(model, name, args), tokens)


def _build_impl(name: str, reference: torch.nn.Module, mesh, tokens, result: ImplResult,
                args: argparse.Namespace):
    """Copy + wrap + two warm-up steps, measuring RSS growth; returns (model, optimizer).

    Memory figures are RSS increases over the RSS before this implementation's model copy
    existed: the peak during step 2 (all state exists by then) and what stays after it.
    """
    gc.collect()
    before = _trimmed_rss_bytes()
    model = _wrap(copy.deepcopy(reference), name, mesh, args)
    optimizer = _optimizer(model, name, args)
    result.losses.append(_over_ranks(_step(model, optimizer, tokens), dist.ReduceOp.AVG))
    gc.collect()
    _reset_peak_rss()
    with _counted_all_gathers() as counts:
        result.losses.append(_over_ranks(_step(model, optimizer, tokens), dist.ReduceOp.AVG))
    result.all_gather_bytes = dict(counts)
    result.peak_step_bytes = int(_over_ranks(_rss_bytes("VmHWM") - before))
    gc.collect()
    result.resident_bytes = int(_over_ranks(_rss_bytes("VmRSS") - before))
    return model, optimizer


def run_alternating(wrapped: Dict[str, Any], tokens: torch.Tensor, results: Dict[str, "ImplResult"], *,
                    steps: int, chunk: int) -> None:
    """``steps`` timed steps of each implementation of ``wrapped`` (``_build_impl``'s), in turns
    of ``chunk`` steps, who goes first alternating between turns."""
    for r in range(-(-steps // chunk)):
        order = IMPLS if r % 2 == 0 else IMPLS[::-1]
        for name in order:
            for _ in range(min(chunk, steps - len(results[name].step_times_s))):
                _timed_step(*wrapped[name], tokens, results[name])


def _timed_step(model, optimizer, tokens, result: ImplResult, step: Callable[..., float] = _step) -> None:
    dist.barrier()
    start, cpu_start = time.perf_counter(), time.process_time()
    step(model, optimizer, tokens)
    get_platform().synchronize()
    cpu, wall = time.process_time() - cpu_start, time.perf_counter() - start
    result.step_times_s.append(_over_ranks(wall))
    result.cpu_times_s.append(_over_ranks(cpu))


def _mesh(args: argparse.Namespace):
    world = dist.get_world_size()
    if args.hsdp:
        if world != 4:
            raise SystemExit(f"--hsdp needs 4 ranks (2x2 mesh), got {world}")
        return hp.init_device_mesh(args.device, (2, 2), mesh_dim_names=("replicate", "shard"))
    return hp.init_device_mesh(args.device, (world,))


def run(args: argparse.Namespace) -> Dict[str, ImplResult]:
    """Build, measure and time both implementations on this rank; results are per implementation."""
    if args.device == "cpu":
        torch.set_num_threads(1)
        _use_mmap_for_large_blocks()
    mesh = _mesh(args)
    torch.manual_seed(0)
    vocab = CONFIGS[args.model]["vocab_size"]
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1),
                           generator=torch.Generator().manual_seed(1000 + dist.get_rank()))
    if args.separate:
        return _run_separately(args, mesh, tokens.to(get_platform().current_device()))
    reference = build_llama(args.model, max_seq_len=args.seq, **_layer_override(args))

    _warm_up(args, mesh, tokens)
    results = {name: ImplResult() for name in IMPLS}
    wrapped = {name: _build_impl(name, reference, mesh, tokens, results[name], args) for name in IMPLS}
    del reference

    run_alternating(wrapped, tokens, results, steps=args.steps, chunk=args.chunk)

    if args.profile:
        for name in IMPLS:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                _step(*wrapped[name], tokens)
            if dist.get_rank() == 0:
                print(f"\n=== {name}: one step, rank 0, by self CPU time ===")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return results


def _run_separately(args: argparse.Namespace, mesh, tokens: torch.Tensor) -> Dict[str, ImplResult]:
    """One implementation at a time: build on meta, shard, materialise on the device, init from
    seed 0 (the same weights for both), two untimed steps (compilation, allocator warm-up),
    then ``--steps`` timed ones with the allocator's (on CPU: the kernel's) peak memory."""
    platform = get_platform()
    results = {}
    for name in IMPLS:
        result = results[name] = ImplResult()
        with torch.device("meta"):
            model = build_llama(args.model, max_seq_len=args.seq, **_layer_override(args))
        _wrap(model, name, mesh, args)
        model.to_empty(device=platform.current_device())
        model.init_weights(0)
        optimizer = _optimizer(model, name, args)
        for _ in range(2):
            with _counted_all_gathers() as counts:
                result.losses.append(_over_ranks(_step(model, optimizer, tokens), dist.ReduceOp.AVG))
        result.all_gather_bytes = dict(counts)
        platform.synchronize()
        gc.collect()
        before = _rss_bytes("VmRSS")
        platform.reset_peak_memory()
        if not platform.is_accelerator:
            _reset_peak_rss()
        for _ in range(args.steps):
            _timed_step(model, optimizer, tokens, result)
        if platform.is_accelerator:
            result.peak_step_bytes = int(_over_ranks(platform.peak_memory_bytes()))
            result.peak_reserved_bytes = int(_over_ranks(platform.device_module.max_memory_reserved()))
            result.resident_bytes = int(_over_ranks(platform.device_module.memory_allocated()))
        else:
            result.peak_step_bytes = int(_over_ranks(_rss_bytes("VmHWM") - before))
            result.resident_bytes = int(_over_ranks(_rss_bytes("VmRSS") - before))
        del model, optimizer
        gc.collect()
        if platform.is_accelerator:
            platform.device_module.empty_cache()
    return results


def _flops_per_token(args: argparse.Namespace) -> float:
    """Training FLOPs per token: 6 x the parameters of every matmul (the output projection
    counted even when tied) + 12 x layers x heads x head_dim x seq for attention."""
    with torch.device("meta"):
        model = build_llama(args.model, max_seq_len=args.seq, **_layer_override(args))
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    cfg = model.cfg
    return 6 * matmul + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * args.seq


def _report(args, results: Dict[str, ImplResult]) -> None:
    torch_r, ours_r = results["torch"], results["ours"]
    mb = 2**20
    world = dist.get_world_size()
    layout = "HSDP 2x2" if args.hsdp else f"FSDP {world}"
    blocks = f" ({args.layers} blocks)" if args.layers is not None else ""
    how = "one after the other" if args.separate else f"alternating, chunks of {args.chunk}"
    compiled = f", compiled ({args.compile_backend})" if args.compile else ", eager"
    compiled += ", float8 tensorwise" if args.float8 else ""
    print(f"\n{args.model}{blocks}, {layout} {get_platform().backend} ranks, batch {args.batch}/rank x "
          f"seq {args.seq}, {args.mixed_precision}{compiled}, {len(torch_r.step_times_s)} timed steps each ({how})")
    print_table(results)
    tokens_per_step = args.batch * args.seq * world
    flops = _flops_per_token(args)
    for name, r in results.items():
        tokens_s = tokens_per_step / r.median_step_s
        reserved = f", peak reserved {r.peak_reserved_bytes / 2**30:.2f} GiB" if r.peak_reserved_bytes else ""
        print(f"{name:16}{tokens_s:,.0f} tokens/s, {flops * tokens_s / world / 1e12:.2f} TFLOP/s per rank, "
              f"peak {r.peak_step_bytes / 2**30:.2f} GiB{reserved}")
    ratios = step_ratios(results)
    for name, r in results.items():
        by_dtype = ", ".join(f"{dtype} {n / mb:.2f}" for dtype, n in sorted(r.all_gather_bytes.items()))
        print(f"{name:16}all-gather MB into one step (rank 0): {sum(r.all_gather_bytes.values()) / mb:.2f} ({by_dtype})")
    ratios["all_gather_bytes"] = sum(ours_r.all_gather_bytes.values()) / sum(torch_r.all_gather_bytes.values())
    if args.float8:
        # Both gather everything else alike: torch's extra bytes are what it gathered for the
        # weights ours gathered as float8 (uint8).
        float8 = ours_r.all_gather_bytes.get("uint8", 0)
        same_weights = sum(torch_r.all_gather_bytes.values()) - (sum(ours_r.all_gather_bytes.values()) - float8)
        ratios["float8_layer_all_gather_bytes"] = float8 / same_weights
        print(f"float8 layers: ours {float8 / mb:.3f} MB (float8) vs torch {same_weights / mb:.3f} MB "
              f"({args.mixed_precision}): {ratios['float8_layer_all_gather_bytes']:.3f}x")
    if torch_r.peak_reserved_bytes:
        ratios["peak_reserved_memory"] = ours_r.peak_reserved_bytes / torch_r.peak_reserved_bytes
    same = print_ratios(ratios, results)
    write_json(args, ratios, same, results)


def print_table(results: Dict[str, ImplResult]) -> None:
    """One row per implementation: step time, CPU time, memory, the first two losses."""
    mb = 2**20
    print(f"{'':16}{'median step s':>14}{'min..max s':>16}{'median CPU s':>14}{'peak step MB':>14}"
          f"{'resident MB':>13}{'loss@1':>12}{'loss@2':>12}")
    for name, r in results.items():
        spread = f"{min(r.step_times_s):.3f}..{max(r.step_times_s):.3f}"
        print(f"{name:16}{r.median_step_s:>14.3f}{spread:>16}{r.median_cpu_s:>14.3f}"
              f"{r.peak_step_bytes / mb:>14.1f}{r.resident_bytes / mb:>13.1f}"
              f"{r.losses[0]:>12.6f}{r.losses[1]:>12.6f}")


def step_ratios(results: Dict[str, ImplResult]) -> Dict[str, float]:
    """ours / torch for step time, CPU time, peak step memory and resident memory."""
    torch_r, ours_r = results["torch"], results["ours"]
    return {
        "step_time": ours_r.median_step_s / torch_r.median_step_s,
        "cpu_time": ours_r.median_cpu_s / torch_r.median_cpu_s,
        "peak_step_memory": ours_r.peak_step_bytes / torch_r.peak_step_bytes,
        "resident_memory": ours_r.resident_bytes / torch_r.resident_bytes,
    }


def print_ratios(ratios: Dict[str, float], results: Dict[str, ImplResult]) -> bool:
    """Print the ratio row and the loss sanity check; whether the losses agree (1e-4 relative)."""
    torch_r, ours_r = results["torch"], results["ours"]
    print(f"{'ours/torch':16}{ratios['step_time']:>14.3f}{'':16}{ratios['cpu_time']:>14.3f}"
          f"{ratios['peak_step_memory']:>14.3f}{ratios['resident_memory']:>13.3f}")
    if "peak_reserved_memory" in ratios:
        print(f"ours/torch peak reserved {ratios['peak_reserved_memory']:.3f}")
    loss_diffs = [abs(a - b) for a, b in zip(ours_r.losses, torch_r.losses)]
    same = all(d <= 1e-4 * abs(t) for d, t in zip(loss_diffs, torch_r.losses))
    print(f"loss sanity (steps 1-2, |ours - torch|): {', '.join(f'{d:.2e}' for d in loss_diffs)}"
          f" -> {'OK' if same else 'MISMATCH'}")
    return same


def write_json(args: argparse.Namespace, ratios: Dict[str, float], same: bool,
               results: Dict[str, ImplResult]) -> None:
    """The run's arguments, ratios and per-implementation results to ``args.json`` (if set)."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "world_size": dist.get_world_size(), "ratios": ratios,
                       "loss_match": same,
                       "results": {n: {**asdict(r), "median_step_s": r.median_step_s,
                                       "median_cpu_s": r.median_cpu_s}
                                   for n, r in results.items()}}, f, indent=2)


def main(argv=None) -> None:
    args = _parse_args(argv)
    launch_benchmark(run, _report, args, 4 if args.hsdp else 2)


if __name__ == "__main__":
    main()
