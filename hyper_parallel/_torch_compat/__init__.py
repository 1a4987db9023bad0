"""The one package through which hyper_parallel reaches private torch names (the fused attention
kernels and their backwards in ``attention_kernels.py``, re-exported here).

Each name below is used because torch has no public equivalent; when a torch release moves or
renames one, this package is the only place to change (``tests/test_torch_compat.py`` calls every
function here through its real use, so such a release fails there first). Verified on the torch versions listed in
the README (``make test-torch TORCH=<version>`` runs the suite on another one).

May import torch only: nothing of hyper_parallel.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.utils._pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: F401  (re-exported)
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: F401
# What a torch DCP ``.metadata`` pickle references besides DCP's public dataclasses: the
# per-item storage location, TensorProperties' memory-format enum, and torch.layout's reducer
# (re-exported; the restricted unpickler in distributed_checkpoint/dcp_interop admits exactly these).
from torch.distributed.checkpoint.filesystem import _StorageInfo as dcp_storage_info  # noqa: F401
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as dcp_mem_format_encoding  # noqa: F401
# FSDP2's per-parameter mesh: what ``shard_placement_fn`` may return (a placement and the mesh
# it shards over) and the mesh descriptions it holds; torch exports them from no public module.
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo  # noqa: F401
from torch.distributed.tensor import Shard

try:
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult  # noqa: F401
except ImportError:  # torch < 2.12 (the GPU image's 2.11): FSDP2 has no per-parameter meshes yet

    @dataclasses.dataclass
    class ShardPlacementResult:  # type: ignore[no-redef]
        """torch 2.12's ``ShardPlacementResult`` (same fields), for torch releases without it."""

        placement: Optional[Shard]
        mesh_info: FSDPMeshInfo
from torch.serialization import _get_layout as get_layout  # noqa: F401
# The base class of a mode that sees every aten op a block runs (torch exports it from no public
# module; hyper_parallel.utils.host_reads counts the ops that read values on the host with it).
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401  (re-exported)

from hyper_parallel._torch_compat.attention_kernels import (  # noqa: F401  (re-exported)
    cpu_flash_attention, cpu_flash_attention_backward, cuda_efficient_attention, cuda_efficient_attention_backward,
    cuda_flash_attention, cuda_flash_attention_applies, cuda_flash_attention_backward)

__all__ = [
    "DTensorSpec",
    "FSDPMeshInfo",
    "HSDPMeshInfo",
    "ShardPlacementResult",
    "HOST_READING_OPS",
    "all_gather_single",
    "TensorMeta",
    "TorchDispatchMode",
    "chunk_cat",
    "clear_dtensor_caches",
    "compute_local_shape_and_global_offset",
    "cpu_flash_attention",
    "cpu_flash_attention_backward",
    "cuda_efficient_attention",
    "cuda_flash_attention",
    "cuda_flash_attention_applies",
    "cuda_flash_attention_backward",
    "cuda_efficient_attention_backward",
    "current_graph_task_id",
    "dcp_fsspec_storage",
    "dcp_mem_format_encoding",
    "dcp_storage_info",
    "disable_functorch_if_active",
    "dtensor_spec",
    "flatten_mesh",
    "dump_cuda_memory_snapshot",
    "dynamo_graphs_compiled",
    "foreach_mul_",
    "fsdp2_export_modules",
    "get_layout",
    "grouped_mm",
    "grouped_mm_dtypes",
    "init_fake_process_group",
    "local_tensor",
    "lookup_compile_backend",
    "module_buffers",
    "module_parameters",
    "preserve_version_counter",
    "process_groups",
    "queue_autograd_callback",
    "record_cuda_memory_history",
    "reduce_scatter_single",
    "set_local_tensor",
    "spmd_mesh_dims",
    "unflatten_mesh",
]

# torch._chunk_cat(tensors, dim, num_chunks): the per-rank interleaving copy FSDP2 uses for
# its reduce-scatter input, one kernel instead of a cat per rank.
chunk_cat = torch._chunk_cat
# torch._foreach_mul_(tensors, scalar_tensor): one multi-tensor kernel (gradient clipping).
foreach_mul_ = torch._foreach_mul_
# torch._grouped_mm(a [rows, k], b [groups, k, n], offs=int32 cumulative row ends): one grouped
# GEMM, group g multiplying rows offs[g-1]:offs[g] of ``a`` by ``b[g]``, forward and backward,
# with the offsets on the device (no host sync). Its kernels read rows and weights through TMA
# loads: every stride a multiple of 16 bytes (the group sizes themselves need no padding in
# bf16 or fp32, as torchtitan 0.3.0 relies on; only float8/MX grouped GEMMs pad the groups).
grouped_mm = torch._grouped_mm
_GROUPED_MM_DTYPES = {
    "cpu": (torch.float32, torch.bfloat16, torch.float16),
    "cuda": (torch.bfloat16,),  # the fused kernel; other dtypes or GPUs run a per-group loop that syncs
}


def grouped_mm_dtypes(device: torch.device) -> Tuple[torch.dtype, ...]:
    """The dtypes :data:`grouped_mm` runs on ``device`` as one kernel without a host sync
    (empty: none). On CUDA that is bf16 on compute capability 9.0 or newer (torch's fused kernel)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        return ()
    return _GROUPED_MM_DTYPES.get(device.type, ())


# The aten ops that read a tensor's values on the host (a scalar, or the size of their output):
# on an accelerator each waits for the device. (``item``/``tolist``/``bool`` reach the first.)
HOST_READING_OPS = frozenset({
    torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default, torch.ops.aten.bincount.default,
    torch.ops.aten.masked_select.default, torch.ops.aten.unique_dim.default, torch.ops.aten._unique2.default,
    torch.ops.aten.unique_consecutive.default,
})
# Context manager: writes inside it do not bump a tensor's version counter (refilling the
# unsharded parameters that autograd saved in forward).
preserve_version_counter = torch.autograd._unsafe_preserve_version_counter


def spmd_mesh_dims(mesh_info: FSDPMeshInfo) -> Optional[Any]:
    """The full-SPMD-mesh description of an FSDP2 mesh info (``dp_mesh_dims``, torch 2.12+);
    None where torch has no such field."""
    fields = {f.name for f in dataclasses.fields(mesh_info)}
    return mesh_info.dp_mesh_dims if "dp_mesh_dims" in fields else None


# torch 2.12 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (the old names
# warn since); the GPU image's torch 2.11 has only the old ones.
_SINGLE_COLLECTIVES = hasattr(dist, "all_gather_single")


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup] = None,
                      async_op: bool = False) -> Optional[dist.Work]:
    """``torch.distributed.all_gather_single`` (``all_gather_into_tensor`` before torch 2.12),
    looked up at call time, so a patched ``torch.distributed`` is honoured."""
    if _SINGLE_COLLECTIVES:
        return dist.all_gather_single(output, input, group=group, async_op=async_op)
    return dist.all_gather_into_tensor(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                          group: Optional[dist.ProcessGroup] = None, async_op: bool = False) -> Optional[dist.Work]:
    """``torch.distributed.reduce_scatter_single`` (``reduce_scatter_tensor`` before torch 2.12),
    looked up at call time."""
    if _SINGLE_COLLECTIVES:
        return dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)
    return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


def process_groups() -> List[dist.ProcessGroup]:
    """Every process group this process created and has not destroyed, the default one included
    (torch lists them in no public API)."""
    return list(dist.distributed_c10d._world.pg_map)


def clear_dtensor_caches() -> None:
    """Empty DTensor's sharding-propagation caches (Python and C++), its redistribute planners and
    transforms, and its mesh topology cache.

    They key on meshes by value (layout, ranks, names), not by their process groups, so after a
    mesh's groups are destroyed an equal new mesh would be handed specs holding the old one; and
    they hold the meshes they saw, with them their process groups (gloo's keep a polling thread
    each)."""
    from torch.distributed.tensor import _collective_utils, _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


def dtensor_spec(dtensor: torch.Tensor) -> DTensorSpec:
    """A DTensor's spec (mesh, placements, global shape and stride) as one object."""
    return dtensor._spec


def module_parameters(module: torch.nn.Module) -> Dict[str, Optional[torch.nn.Parameter]]:
    """The dict holding ``module``'s own parameters: fully_shard swaps its sharded and
    unsharded parameters in there directly (as FSDP2 does), without ``nn.Module.__setattr__``."""
    return module._parameters


def module_buffers(module: torch.nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    """The dict holding ``module``'s own buffers (filled in place like :func:`module_parameters`)."""
    return module._buffers


def post_accumulate_grad_hooks(param: torch.Tensor) -> Dict[Any, Callable]:
    """The hooks registered with ``register_post_accumulate_grad_hook`` on ``param`` (empty if none)."""
    return param._post_accumulate_grad_hooks or {}


def local_tensor(dtensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor itself (``to_local()`` returns an autograd view of it)."""
    return dtensor._local_tensor


def set_local_tensor(dtensor: torch.Tensor, local: torch.Tensor) -> None:
    """Re-point a DTensor at ``local`` (same shape and dtype): fully_shard binds its sharded
    parameters to views of the group's flat shard buffer, as FSDP2 does."""
    dtensor._local_tensor = local


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh`` (a slice of a root mesh) as one dim ``name``, row-major, its process group
    created on every rank (torch has no public flatten)."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: DeviceMesh, dim: int, sizes: Tuple[int, ...], names: Tuple[str, ...]) -> DeviceMesh:
    """``mesh`` with dim ``dim`` split into the named dims ``sizes`` (row-major), its process
    groups created on every rank; the result's slices come from ``mesh``'s root mesh, so they
    can be joined with its other slices (torch has no public unflatten)."""
    return mesh._unflatten(dim, sizes, names)


def mesh_dim_rank_groups(mesh: DeviceMesh, dim: int) -> List[List[int]]:
    """The ranks of every process group of ``mesh``'s dim ``dim`` over its root mesh: this rank's
    and those of the sibling slices the other ranks hold, each in mesh order, in the order torch's
    DeviceMesh creates them (its ``_init_one_process_group``; torch has no public way to list
    them)."""
    from torch.distributed._mesh_layout import _MeshLayout

    layout = mesh._layout[dim]
    if not isinstance(layout, _MeshLayout):  # torch 2.12+: one axis of a layout is a _FlatLayout
        layout = _MeshLayout([layout])
    return layout.remap_to_tensor(mesh._get_root_mesh()._rank_map).tolist()


def current_graph_task_id() -> int:
    """The running autograd graph task's id, -1 outside backward."""
    return torch._C._current_graph_task_id()


def queue_autograd_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass has finished (must be in backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def register_pytree_node(cls: type, flatten: Callable[[Any], Tuple[List[Any], Any]],
                         unflatten: Callable[[List[Any], Any], Any]) -> None:
    """Make ``cls`` a pytree node: ``flatten(obj) -> (children, context)`` and ``unflatten(children,
    context) -> obj``, so that code walking arguments as pytrees (torch's pipeline micro-batch
    split) reaches the tensors inside it."""
    torch.utils._pytree.register_pytree_node(cls, flatten, unflatten)


def pipeline_sum_reducer() -> Any:
    """torch's pipeline output-merge spec that sums the last stage's per-micro-batch outputs
    (0-dim tensors) instead of concatenating them; torch exports it from no public module."""
    from torch.distributed.pipelining.microbatch import sum_reducer

    return sum_reducer


def lookup_compile_backend(name: str) -> Callable:
    """The torch.compile backend callable registered as ``name`` (e.g. ``"aot_eager"``)."""
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(name)


def dynamo_graphs_compiled() -> int:
    """How many graphs dynamo has captured and handed to a backend in this process (it never
    decreases; ``torch.compiler.reset()`` makes the next calls compile afresh). Its counters
    are torch's only record of what ``torch.compile`` compiled."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def record_cuda_memory_history(max_entries: Optional[int]) -> None:
    """Start recording CUDA allocator events (``None``: stop); torch has no public switch."""
    if max_entries is None:
        torch.cuda.memory._record_memory_history(enabled=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=max_entries)


def dump_cuda_memory_snapshot(path: str) -> None:
    """Write the recorded CUDA allocator history to ``path`` (pickle, for pytorch.org/memory_viz)."""
    torch.cuda.memory._dump_snapshot(path)


_functorch_transforms_active = torch._C._are_functorch_transforms_active
_DisableFuncTorch = torch._C._DisableFuncTorch


def disable_functorch_if_active(func: Callable) -> Callable:
    """Run ``func`` outside functorch transforms (``torch.func.jvp``/``vmap``): fully_shard's
    buffers and collectives must be plain tensors, never transform-level wrappers."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if _functorch_transforms_active():
            with _DisableFuncTorch():
                return func(*args, **kwargs)
        return func(*args, **kwargs)

    return wrapper


def init_fake_process_group(rank: int, world_size: int) -> None:
    """Start torch's ``fake`` process group as ``rank`` of ``world_size``: collectives are
    no-ops, so one process can stand for any rank of a large job (planning benchmarks, tests).
    Its store lives in torch's test utilities; torch has no public one."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def dcp_fsspec_storage() -> Tuple[type, type]:
    """torch DCP's fsspec ``(FsspecWriter, FsspecReader)`` classes: public from torch 2.15
    (``torch.distributed.checkpoint``), a private module before (benchmarks compare with them)."""
    try:
        from torch.distributed.checkpoint import FsspecReader, FsspecWriter
    except ImportError:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    return FsspecWriter, FsspecReader


# The modules through which torch re-exports FSDP2's public names (fully_shard, FSDPModule, the
# policies, register_fsdp_forward_method) for programs to import: the public one and the deprecated
# path (patch_torch_fsdp replaces the names in each that torch of this version has). Never the
# modules defining them (torch.distributed.fsdp._fully_shard._fully_shard, _fsdp_api) nor the
# package torch's own code reads them from: torch's functions read those globals when they run.
_FSDP2_EXPORT_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)


def fsdp2_export_modules() -> list:
    """The imported modules of :data:`_FSDP2_EXPORT_MODULES` this torch has."""
    import importlib
    import warnings

    modules = []
    for name in _FSDP2_EXPORT_MODULES:
        try:
            with warnings.catch_warnings():  # (torch.distributed._composable.fsdp: deprecated path)
                warnings.simplefilter("ignore")
                modules.append(importlib.import_module(name))
        except ImportError:
            continue
    return modules


# The globals by which torch.save's pickles rebuild a tensor (torch/_utils.py), by version.
_TENSOR_REBUILDERS = {("torch._utils", "_rebuild_tensor_v2"): 2, ("torch._utils", "_rebuild_tensor_v3"): 3}


def tensor_rebuild_version(module: str, name: str) -> Optional[int]:
    """2 or 3 when ``module.name`` is the v2 / v3 tensor rebuild function of torch's pickles
    (a restricted unpickler admits them as descriptions, not calls); None otherwise."""
    return _TENSOR_REBUILDERS.get((module, name))
