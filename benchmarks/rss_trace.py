"""Where a training step's peak RSS comes from: torch FSDP2 vs hp.fully_shard, phase by phase.

Same model, inputs and ranks as ``benchmarks/fsdp_step.py`` (llama_50m, FSDP on 2 gloo
ranks, fp32, eager, glibc returning freed blocks >= 64 KiB to the OS). After one untraced step
of each implementation, one traced step records, at every probe, the process RSS and the peak
RSS since the previous probe (``VmHWM``, reset at each probe), both relative to the RSS before
the step. Probes: each block's forward pre/post hooks and the pre-backward (a hook on its output
gradient, and likewise for
each block's submodules), plus entry and exit of each implementation's unshard / reshard / reduce functions.

    python benchmarks/rss_trace.py [--layers N] [--all]   # rank 0 prints; --all: every probe

The table per implementation lists each phase (the span from one probe to the next) whose peak
is within ``--top`` MB of the step's peak, so the two can be compared at the moment of the peak.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import os
from typing import Callable, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as torch_group

import hyper_parallel as hp
from hyper_parallel.core.fully_shard import param_group as hp_group
from hyper_parallel.models import build_llama
from hyper_parallel.models.llama import CONFIGS
from hyper_parallel.platform import free_port

import fsdp_step as bench

MB = 2**20
# Functions whose entry and exit are probes, per implementation: (owner, attribute name).
_PROBED = {
    "torch": [(torch_group.FSDPParamGroup, n) for n in ("pre_backward", "post_backward", "unshard",
                                                        "wait_for_unshard", "reshard")]
             + [(torch_group, "foreach_reduce")],
    "ours": [(hp_group.HSDPParamGroup, n) for n in ("reduce_grads", "finish_scatter", "unshard",
                                                    "wait_for_unshard", "reshard")],
}


class Tracer:
    """Records (label, RSS now, peak since the previous probe) in MB over a baseline."""

    def __init__(self) -> None:
        self.records: List[Tuple[str, float, float]] = []
        self.base = 0
        self.active = False

    def start(self) -> None:
        self.records = []
        self.base = bench._rss_bytes("VmRSS")
        bench._reset_peak_rss()
        self.active = True

    def probe(self, label: str) -> None:
        if not self.active:
            return
        peak = bench._rss_bytes("VmHWM")
        now = bench._rss_bytes("VmRSS")
        bench._reset_peak_rss()
        self.records.append((label, (now - self.base) / MB, (peak - self.base) / MB))


def _wrap_fn(fn: Callable, name: str, tracer: Tracer, index: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        tag = f"{name}[{index(args)}]"
        tracer.probe(f"> {tag}")
        result = fn(*args, **kwargs)
        tracer.probe(f"< {tag}")
        return result
    return wrapper


def _install(impl: str, model: torch.nn.Module, tracer: Tracer) -> Callable[[], None]:
    """Probe ``model``'s blocks and ``impl``'s functions; returns the undo."""
    groups = {}
    for i, block in enumerate(model.layers.values()):
        for group in _groups_of(block):
            groups[id(group)] = f"b{i}"
    for group in _groups_of(model):
        groups.setdefault(id(group), "root")

    def index(args):
        return groups.get(id(args[0]), "?") if args else "?"

    undo = []
    for owner, name in _PROBED[impl]:
        original = getattr(owner, name)
        setattr(owner, name, _wrap_fn(original, name, tracer, index))
        undo.append(functools.partial(setattr, owner, name, original))
    handles = []
    for i, block in enumerate(model.layers.values()):
        handles.append(block.register_forward_pre_hook(lambda *_, i=i: tracer.probe(f"fwd b{i}")))

        def post(_m, _a, out, i=i):
            tracer.probe(f"fwd end b{i}")
            if out.requires_grad:
                out.register_hook(lambda g, i=i: tracer.probe(f"bwd b{i}"))
        handles.append(block.register_forward_hook(post))
        for name, child in block.named_children():
            def child_post(_m, _a, out, label=f"bwd b{i}.{name} (its output grad)"):
                if out.requires_grad:
                    out.register_hook(lambda g: tracer.probe(label))
            handles.append(child.register_forward_hook(child_post))
    undo.extend(h.remove for h in handles)
    return lambda: [u() for u in undo]


def _groups_of(module: torch.nn.Module) -> list:
    """The parameter group object(s) of one sharded module, for either implementation."""
    state = module.__dict__.get("_hsdp_state")
    if state is not None:
        return [state.group]
    if isinstance(module, FSDPModule):
        group = module._get_fsdp_state()._fsdp_param_group
        return [group] if group is not None else []
    return []


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    bench._use_mmap_for_large_blocks()
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    vocab = CONFIGS[args.model]["vocab_size"]
    tokens = torch.randint(0, vocab, (2, 257), generator=torch.Generator().manual_seed(1000 + dist.get_rank()))
    bench_args = bench._parse_args(["--model", args.model] + (["--layers", str(args.layers)] if args.layers else []))
    reference = build_llama(args.model, max_seq_len=256, **bench._layer_override(bench_args))
    bench._warm_up(bench_args, mesh, tokens)
    tracer = Tracer()
    for impl in args.impls.split(","):
        model = bench._wrap(copy.deepcopy(reference), impl, mesh, bench_args)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        bench._step(model, optimizer, tokens)
        undo = _install(impl, model, tracer)
        tracer.start()
        bench._step(model, optimizer, tokens)
        tracer.probe("step end")
        tracer.active = False
        undo()
        records = tracer.records
        peaks = torch.tensor([r[2] for r in records], dtype=torch.float64)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        if dist.get_rank() == 0:
            top = max(r[2] for r in records)
            print(f"\n=== {impl}: step peak +{top:.1f} MB over the step's start (rank 0), "
                  f"max over ranks {peaks.max().item():.1f}; {len(records)} probes ===")
            print(f"{'probe (phase ends here)':44}{'RSS now':>10}{'peak in phase':>15}")
            for label, now, peak in records:
                if args.all or peak >= top - args.top:
                    print(f"{label:44}{now:>10.1f}{peak:>15.1f}")
        del model, optimizer
        gc.collect()


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), HYPER_PARALLEL_DEVICE="cpu")
    hp.init_distributed()
    try:
        run(args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama_50m")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--impls", default="torch,ours")
    parser.add_argument("--top", type=float, default=3.0, help="show phases within this many MB of the peak")
    parser.add_argument("--all", action="store_true", help="show every probe")
    args = parser.parse_args()
    mp.spawn(_spawned, args=(2, free_port(), args), nprocs=2, join=True)


if __name__ == "__main__":
    main()
