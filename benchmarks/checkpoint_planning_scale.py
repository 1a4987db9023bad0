"""Save and resharding-load planning for simulated 1,024 / 4,096 / 16,384-rank jobs, in one process.

State: a Llama-3-8B-shaped model state dict (32 layers, 291 bf16 tensors, 8.03e9 parameters)
as FSDP (1-D mesh, ``Shard(0)``) or HSDP (mesh ``(W/8, 8)``, ``(Replicate(), Shard(0))``).
No collective runs; a fake process group (torch's ``fake`` backend) gives the meshes.

- **rank 0, local save planning**: the real ``StandardSavePlanner`` on meta DTensors; time and
  the pickled plan it would send to the coordinator.
- **coordinator, global save planning**: the real ``build_global_plan`` over all W local
  plans. The other ranks' plans are built from the ``Shard(0)`` arithmetic and the planner's
  replica rule; the real planner's plans of ranks 0, W/2 - 1 and W - 1 are checked equal to them.
- **metadata**: the committed JSON (chunks, one storage location per chunk in ``__{rank}_0``
  files as the writer names them, the files' sizes); what the coordinator does with it on load
  (``read_checkpoint_metadata``: parse and ``check_metadata``); what every rank then holds
  (the parsed metadata, sent pickled by the coordinator).
- **rank 0, resharding load planning**: the real ``StandardLoadPlanner`` loading the other
  layout's checkpoint (FSDP checkpoint -> HSDP state and back), ``use_collectives=False``.

Times are this process's CPU seconds (``time.process_time``), measured untraced; memory
figures come from a second, ``tracemalloc``-traced run of the same step (Python allocations):
"peak" is the step's peak, "held" what stays allocated after it. Tracing the coordinator's
steps (``--trace-coordinator``) triples their cost at 16,384 ranks, so it is optional. Run:

    python benchmarks/checkpoint_planning_scale.py [--worlds 1024 4096 16384] [--kinds fsdp hsdp]
        [--trace-coordinator]
"""

from __future__ import annotations

import argparse
import gc
import pickle
import time
import tracemalloc
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import hyper_parallel.checkpoint as hdcp
from hyper_parallel._torch_compat import compute_local_shape_and_global_offset, init_fake_process_group
from hyper_parallel.core.distributed_checkpoint.planner import TensorWriteData
from hyper_parallel.core.distributed_checkpoint.format.validation import check_metadata

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


def _meta_state(shapes, mesh, placements) -> Dict[str, DTensor]:
    """Meta DTensors of this rank's shards (no memory)."""
    state = {}
    for key, shape in shapes.items():
        local, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        state[key] = DTensor.from_local(torch.empty(local, dtype=DTYPE, device="meta"), mesh, placements,
                                        run_check=False, shape=torch.Size(shape), stride=tuple(strides))
    return {"model": state}


def _init(world: int, rank: int, kind: str):
    if dist.is_initialized():
        dist.destroy_process_group()
    init_fake_process_group(rank, world)
    mesh_shape, placements, names = _layout(kind, world)
    return init_device_mesh("cpu", mesh_shape, mesh_dim_names=names), placements


def _shard0(rows: int, parts: int, index: int) -> Tuple[int, int]:
    """(start, length) of piece ``index`` of ``rows`` split into ``parts`` by ``Shard(0)``."""
    step = -(-rows // parts)
    start = min(index * step, rows)
    return start, min(rows, start + step) - start


def _synthesized_plans(shapes, kind: str, world: int) -> List[hdcp.SavePlan]:
    """Every rank's local save plan from the ``Shard(0)`` arithmetic and the planner's rule: a
    replicated chunk is written by the first of its least loaded holders, by bytes in key order."""
    mesh_shape, placements, names = _layout(kind, world)
    items: List[list] = [[] for _ in range(world)]
    layouts: List[dict] = [{} for _ in range(world)]
    layout = {"mesh_shape": list(mesh_shape), "mesh_dim_names": list(names or ()),
              "placements": [str(p) for p in placements]}
    parts = world if kind == "fsdp" else HSDP_SHARD
    loads = [defaultdict(int) for _ in range(parts)]
    for name in sorted(shapes, key=lambda k: "model." + k):  # the planner's order: flattened keys
        key, shape = "model." + name, shapes[name]
        rest = tuple(shape[1:])
        for piece in range(parts):
            start, rows = _shard0(shape[0], parts, piece)
            if rows == 0:
                continue
            if kind == "fsdp":
                owner = piece
            else:
                owner = min(range(piece, world, HSDP_SHARD), key=loads[piece].__getitem__)
                loads[piece][owner] += rows * torch.Size(rest).numel() * DTYPE.itemsize
            chunk = hdcp.ChunkStorageMetadata((start,) + (0,) * len(rest), (rows,) + rest)
            items[owner].append(hdcp.WriteItem(hdcp.MetadataIndex(key, chunk.offsets), hdcp.WriteItemType.TENSOR,
                                               TensorWriteData(chunk, DTYPE, tuple(shape))))
            layouts[owner][key] = layout
    return [hdcp.SavePlan(items[r], layouts=layouts[r]) for r in range(world)]


def _record_storage(metadata: hdcp.Metadata, plans: List[hdcp.SavePlan]) -> None:
    """The storage locations the writer would record: rank r's chunks back to back in
    ``__{r}_0.safetensors`` after its header, with a crc32 each."""
    for rank, plan in enumerate(plans):
        if not plan.items:
            continue
        name, position = f"__{rank}_0.safetensors", 8 + 96 * len(plan.items)
        for item in plan.items:
            length = torch.Size(item.tensor_data.chunk.sizes).numel() * DTYPE.itemsize
            crc = (position * 2654435761) & 0xFFFFFFFF
            metadata.storage_data[item.index] = hdcp.StorageInfo(name, position, length, crc)
            position += length
        metadata.files[name] = hdcp.FileInfo(position, (position * 40503) & 0xFFFFFFFF)


def _timed(fn: Callable[[], object]) -> Tuple[object, float]:
    """(result, CPU seconds of this process) of ``fn``, untraced: CPU time, not wall time, so
    that the time other processes of a loaded machine take is not counted."""
    start = time.process_time()
    result = fn()
    return result, time.process_time() - start


def _traced(fn: Callable[[], object]) -> Tuple[object, int, int]:
    """(result, peak bytes, bytes still held after) of ``fn`` under ``tracemalloc``."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    result = fn()
    gc.collect()
    held, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return result, peak - before, held - before


def _save_planner(shapes, kind: str, world: int, rank: int) -> Callable[[], hdcp.SavePlan]:
    state = _meta_state(shapes, *_init(world, rank, kind))

    def plan() -> hdcp.SavePlan:
        planner = hdcp.StandardSavePlanner()
        planner.configure_planner(state, rank=rank)
        return planner.build_local_plan()

    return plan


def _load_planner(shapes, kind: str, world: int, metadata: hdcp.Metadata) -> Callable[[], hdcp.LoadPlan]:
    state = _meta_state(shapes, *_init(world, 0, kind))

    def plan() -> hdcp.LoadPlan:
        planner = hdcp.StandardLoadPlanner()
        planner.configure_planner(state, metadata, rank=0, use_collectives=False)
        return planner.build_local_plan()

    return plan


def _read_metadata(text: str) -> hdcp.Metadata:
    """What ``read_checkpoint_metadata`` does with the file's text on the coordinator."""
    metadata = hdcp.Metadata.from_json(text, "bench")
    check_metadata(metadata, "bench")
    return metadata


def _mb(nbytes: Optional[float]) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{nbytes / 1e3:.1f} KB"


def _row(shapes, kind: str, world: int, trace_coordinator: bool) -> str:
    plans = _synthesized_plans(shapes, kind, world)
    gc.collect()
    local, local_s = _timed(_save_planner(shapes, kind, world, 0))
    for rank in (0, world // 2 - 1, world - 1):
        real = local if rank == 0 else _save_planner(shapes, kind, world, rank)()
        assert (real.items, real.layouts) == (plans[rank].items, plans[rank].layouts), f"rank {rank} differs"
    coordinator = hdcp.StandardSavePlanner()
    coordinator.configure_planner({}, rank=0)
    (final, metadata), global_s = _timed(lambda: coordinator.build_global_plan(plans))
    global_peak = _traced(lambda: coordinator.build_global_plan(plans))[1] if trace_coordinator else None
    _record_storage(metadata, final)
    chunks = sum(len(md.chunks) for md in metadata.state_dict_metadata.values())
    text = metadata.to_json()
    del plans, final, metadata
    parsed, read_s = _timed(lambda: _read_metadata(text))
    read_peak = _traced(lambda: _read_metadata(text))[1] if trace_coordinator else None
    sent = pickle.dumps(parsed)
    del parsed
    held_metadata, _, held = _traced(lambda: pickle.loads(sent))
    other = "hsdp" if kind == "fsdp" else "fsdp"
    plan = _load_planner(shapes, other, world, held_metadata)
    load, load_s = _timed(plan)
    _, load_peak, _ = _traced(plan)
    return (f"| {world} | {kind} (load as {other}) | {chunks} | {local_s:.2f} s / {_mb(len(pickle.dumps(local)))} | "
            f"{global_s:.2f} s / {_mb(global_peak)} | {_mb(len(text))} | {read_s:.2f} s / {_mb(read_peak)} | "
            f"{_mb(len(sent))} / {_mb(held)} | {load_s:.2f} s / {_mb(load_peak)} / {len(load.items)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--kinds", nargs="+", choices=("fsdp", "hsdp"), default=["fsdp", "hsdp"])
    parser.add_argument("--trace-coordinator", action="store_true",
                        help="also trace the coordinator's global plan and metadata read for their peak memory")
    args = parser.parse_args()
    shapes = llama8b_shapes()
    params = sum(torch.Size(s).numel() for s in shapes.values())
    print(f"state: {len(shapes)} bf16 tensors, {params / 1e9:.2f}e9 parameters (Llama-3-8B shapes); "
          f"HSDP = (world/{HSDP_SHARD}, {HSDP_SHARD}) mesh; torch {torch.__version__}\n")
    print("| ranks | layout | chunks | rank 0 save plan: s / sent | coordinator global plan: s / peak "
          "| metadata JSON | coordinator reads it: s / peak | every rank: received / held "
          "| rank 0 reshard load plan: s / peak / reads |")
    print("|---|---|---|---|---|---|---|---|---|")
    for world in args.worlds:
        for kind in args.kinds:
            print(_row(shapes, kind, world, args.trace_coordinator), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
