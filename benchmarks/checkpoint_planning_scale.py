"""Save and resharding-load planning for simulated 1,024 / 4,096 / 16,384-rank jobs, in one process.

State: a Llama-3-8B-shaped model state dict (32 layers, 291 bf16 tensors, 8.03e9 parameters)
as FSDP (1-D mesh, ``Shard(0)``) or HSDP (mesh ``(W/8, 8)``, ``(Replicate(), Shard(0))``).
No collective runs; a fake process group (torch's ``fake`` backend) gives the meshes.

- **rank 0, local save planning**: the real ``StandardSavePlanner`` on meta DTensors; time and
  the pickled plan it would send to the coordinator.
- **coordinator, global save planning**: the real ``build_global_plan`` over all W local
  plans. The other ranks' plans are built from torch's own placement math
  (``_compute_local_shape_and_global_offset`` with each rank's coordinate) and the planner's
  replica rule; the real planner's plans of ranks 0 and W-1 are checked equal to them.
- **metadata**: the committed JSON every rank reads on load, and its in-memory size.
- **rank 0, resharding load planning**: the real ``StandardLoadPlanner`` loading the other
  layout's checkpoint (FSDP checkpoint -> HSDP state and back), ``use_collectives=False``.

Memory figures are ``tracemalloc`` peaks of the step (Python allocations). Run:

    python benchmarks/checkpoint_planning_scale.py [--worlds 1024 4096 16384]
"""

from __future__ import annotations

import argparse
import pickle
import time
import tracemalloc
from collections import defaultdict
from typing import Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.testing._internal.distributed.fake_pg import FakeStore

import hyper_parallel.checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.planner import TensorWriteData

HSDP_SHARD = 8  # ranks per shard group (one node)
DTYPE = torch.bfloat16


def llama8b_shapes() -> Dict[str, Tuple[int, ...]]:
    """Llama-3-8B: vocab 128256, dim 4096, 32 layers, 8 KV heads of 128, FFN 14336."""
    shapes = {"tok_embeddings.weight": (128256, 4096), "norm.weight": (4096,), "output.weight": (128256, 4096)}
    for i in range(32):
        p = f"layers.{i}."
        shapes.update({p + "attention.wq.weight": (4096, 4096), p + "attention.wk.weight": (1024, 4096),
                       p + "attention.wv.weight": (1024, 4096), p + "attention.wo.weight": (4096, 4096),
                       p + "feed_forward.w1.weight": (14336, 4096), p + "feed_forward.w3.weight": (14336, 4096),
                       p + "feed_forward.w2.weight": (4096, 14336), p + "attention_norm.weight": (4096,),
                       p + "ffn_norm.weight": (4096,)})
    return shapes


def _layout(kind: str, world: int):
    if kind == "fsdp":
        return (world,), (Shard(0),), None
    return (world // HSDP_SHARD, HSDP_SHARD), (Replicate(), Shard(0)), ("replicate", "shard")


def _coordinate(rank: int, mesh_shape) -> List[int]:
    return [rank] if len(mesh_shape) == 1 else [rank // mesh_shape[1], rank % mesh_shape[1]]


def _meta_state(shapes, mesh, placements) -> Dict[str, DTensor]:
    """Meta DTensors of this rank's shards (no memory)."""
    state = {}
    for key, shape in shapes.items():
        local, _ = _compute_local_shape_and_global_offset(shape, mesh.shape, mesh.get_coordinate(), placements)
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        state[key] = DTensor.from_local(torch.empty(local, dtype=DTYPE, device="meta"), mesh, placements,
                                        run_check=False, shape=torch.Size(shape), stride=tuple(strides))
    return {"model": state}


def _init(world: int, rank: int, kind: str):
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    mesh_shape, placements, names = _layout(kind, world)
    return init_device_mesh("cpu", mesh_shape, mesh_dim_names=names), placements


def _synthesized_plans(shapes, kind: str, world: int) -> List[hdcp.SavePlan]:
    """Every rank's local save plan from torch's placement math and the planner's rule: a
    chunk is written by one of its holders, balanced by bytes in key order."""
    mesh_shape, placements, names = _layout(kind, world)
    items: List[list] = [[] for _ in range(world)]
    layouts: List[dict] = [{} for _ in range(world)]
    replica_load: Dict[tuple, Dict[int, int]] = defaultdict(lambda: defaultdict(int))
    layout = {"mesh_shape": list(mesh_shape), "mesh_dim_names": list(names or ()),
              "placements": [str(p) for p in placements]}
    for name in sorted(shapes, key=lambda k: "model." + k):  # the planner's order: flattened keys
        key, shape = "model." + name, shapes[name]
        for rank in range(world):
            coord = _coordinate(rank, mesh_shape)
            sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh_shape, coord, placements)
            if 0 in sizes:
                continue
            holders = [rank] if kind == "fsdp" else [r * mesh_shape[1] + coord[1] for r in range(mesh_shape[0])]
            load = replica_load[tuple(holders)]
            if rank == holders[0]:  # every holder computes the same owner; do it once
                owner = min(holders, key=lambda r: (load[r], holders.index(r)))
                load[owner] += torch.Size(sizes).numel() * DTYPE.itemsize
                chunk = hdcp.ChunkStorageMetadata(tuple(offsets), tuple(sizes))
                items[owner].append(hdcp.WriteItem(hdcp.MetadataIndex(key, chunk.offsets), hdcp.WriteItemType.TENSOR,
                                                   TensorWriteData(chunk, DTYPE, tuple(shape))))
                layouts[owner][key] = layout
    return [hdcp.SavePlan(items[r], layouts=layouts[r]) for r in range(world)]


def _timed(fn: Callable[[], object]) -> Tuple[object, float, int]:
    """(result, seconds, tracemalloc peak bytes) of ``fn``."""
    tracemalloc.start()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return result, seconds, peak


def _local_save_plan(shapes, kind: str, world: int, rank: int):
    mesh, placements = _init(world, rank, kind)
    state = _meta_state(shapes, mesh, placements)
    planner = hdcp.StandardSavePlanner()

    def plan():
        planner.configure_planner(state, rank=rank)
        return planner.build_local_plan()

    return _timed(plan)


def _load_plan(shapes, kind: str, world: int, metadata: hdcp.Metadata):
    mesh, placements = _init(world, 0, kind)
    state = _meta_state(shapes, mesh, placements)
    planner = hdcp.StandardLoadPlanner()

    def plan():
        planner.configure_planner(state, metadata, rank=0, use_collectives=False)
        return planner.build_local_plan()

    return _timed(plan)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.1f} KB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1024, 4096, 16384])
    args = parser.parse_args()
    shapes = llama8b_shapes()
    params = sum(torch.Size(s).numel() for s in shapes.values())
    print(f"state: {len(shapes)} bf16 tensors, {params / 1e9:.2f}e9 parameters (Llama-3-8B shapes); "
          f"HSDP = (world/{HSDP_SHARD}, {HSDP_SHARD}) mesh; torch {torch.__version__}\n")
    print("| ranks | layout | rank 0 save plan: s / sent | coordinator global plan: s / peak mem "
          "| chunks | metadata JSON | metadata in memory | rank 0 reshard load plan: s / peak mem |")
    print("|---|---|---|---|---|---|---|---|")
    for world in args.worlds:
        for kind in ("fsdp", "hsdp"):
            plans = _synthesized_plans(shapes, kind, world)
            (local, local_s, _) = _local_save_plan(shapes, kind, world, 0)
            last, _, _ = _local_save_plan(shapes, kind, world, world - 1)
            assert local.items == plans[0].items and last.items == plans[-1].items, "synthesized plans differ"
            assert local.layouts == plans[0].layouts
            coordinator = hdcp.StandardSavePlanner()
            coordinator.configure_planner({}, rank=0)
            (global_plans, metadata), global_s, global_peak = _timed(lambda: coordinator.build_global_plan(plans))
            text = metadata.to_json()
            parsed, _, parse_peak = _timed(lambda: hdcp.Metadata.from_json(text))
            chunks = sum(len(md.chunks) for md in metadata.state_dict_metadata.values())
            other = "hsdp" if kind == "fsdp" else "fsdp"
            _, load_s, load_peak = _load_plan(shapes, other, world, parsed)
            print(f"| {world} | {kind} (load as {other}) | {local_s:.2f} s / {_mb(len(pickle.dumps(local)))} | "
                  f"{global_s:.2f} s / {_mb(global_peak)} | {chunks} | {_mb(len(text))} | {_mb(parse_peak)} | "
                  f"{load_s:.2f} s / {_mb(load_peak)} |", flush=True)
            del plans, global_plans, metadata, parsed, text
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
