"""Every private torch name hyper_parallel uses resolves on the installed torch and does what
the package relies on.

A name ``_torch_compat`` binds at import (a re-export or an alias) fails ``import
hyper_parallel`` when torch renames it; a function of ``_torch_compat`` reaches its private
name only when called, so each such function is called here through its real use (a real
DTensor on a ``fake`` process group, a real backward, a real functorch transform), and
:func:`test_every_compat_function_is_called_here` fails for one added without a test.
"""

from __future__ import annotations

import inspect
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from hyper_parallel import _torch_compat as compat


@pytest.fixture
def rank_2_of_4():
    """A 1-D mesh of 4 ranks on a ``fake`` process group, as rank 2."""
    assert not dist.is_initialized(), "a test left a process group behind"
    compat.init_fake_process_group(rank=2, world_size=4)
    try:
        yield init_device_mesh("cpu", (4,))
    finally:
        dist.destroy_process_group()


def _rows_6_to_8_of_10(mesh) -> DTensor:
    """Rank 2's shard (rows 6-8) of a 10 x 3 tensor sharded on dim 0 over 4 ranks."""
    local = torch.arange(6.0, 9.0).repeat_interleave(3).view(3, 3)
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size((10, 3)), stride=(3, 1))


def test_every_name_resolves():
    for name in compat.__all__:
        assert getattr(compat, name) is not None, name


def test_every_compat_function_is_called_here():
    functions = {name for name, value in vars(compat).items()
                 if inspect.isfunction(value) and value.__module__ == compat.__name__ and not name.startswith("_")}
    tests = {name for name in vars(sys.modules[__name__]) if name.startswith("test_")}
    untested = sorted(f for f in functions if not any(f in t for t in tests))
    assert not untested, f"_torch_compat functions without a test naming them here: {untested}"


def test_dcp_fsspec_storage():
    pytest.importorskip("fsspec")
    from torch.distributed.checkpoint import StorageReader, StorageWriter

    writer, reader = compat.dcp_fsspec_storage()
    assert issubclass(writer, StorageWriter) and issubclass(reader, StorageReader)


def test_fsdp2_export_modules():
    from torch.distributed import fsdp

    modules = compat.fsdp2_export_modules()
    assert modules[0] is fsdp
    assert all(vars(m).get("fully_shard", fsdp.fully_shard) is fsdp.fully_shard for m in modules)
    names = {m.__name__ for m in modules}
    assert "torch.distributed._composable.fsdp" in names
    assert not any(name.startswith("torch.distributed.fsdp._fully_shard") for name in names)  # torch reads those


def test_tensor_rebuild_version():
    import io

    buffer = io.BytesIO()
    torch.save(torch.arange(3), buffer)  # names the rebuild function torch's pickles use today
    assert b"_rebuild_tensor_v2" in buffer.getvalue()
    assert compat.tensor_rebuild_version("torch._utils", "_rebuild_tensor_v2") == 2
    assert compat.tensor_rebuild_version("torch._utils", "_rebuild_tensor_v3") == 3
    assert compat.tensor_rebuild_version("torch._utils", "_rebuild_parameter") is None
    assert compat.tensor_rebuild_version("os", "system") is None


def test_chunk_cat():
    a, b = torch.arange(4.0).view(2, 2), torch.arange(4.0, 6.0).view(2, 1)
    # rank-major chunks: rank 0 gets row 0 of each tensor, rank 1 row 1
    assert compat.chunk_cat([a, b], dim=0, num_chunks=2).tolist() == [[0, 1, 4], [2, 3, 5]]


def test_foreach_mul_and_preserve_version_counter():
    t = torch.ones(2)
    compat.foreach_mul_([t], torch.tensor(3.0))
    assert t.tolist() == [3.0, 3.0]
    version = t._version
    with compat.preserve_version_counter(t):
        t.add_(1)
    assert t._version == version


def test_current_graph_task_id_and_queue_autograd_callback():
    assert compat.current_graph_task_id() == -1  # outside backward
    seen = []
    x = torch.ones(1, requires_grad=True)
    x.register_hook(lambda g: compat.queue_autograd_callback(lambda: seen.append(compat.current_graph_task_id())))
    (x * 2).sum().backward()
    assert len(seen) == 1 and seen[0] != -1


def test_queue_autograd_callback_runs_after_the_backward_pass():
    order = []
    x = torch.ones(1, requires_grad=True)
    x.register_hook(lambda g: compat.queue_autograd_callback(lambda: order.append("callback")))
    y = x * 2
    y.register_hook(lambda g: order.append("hook"))
    (y * 3).sum().backward()
    assert order == ["hook", "callback"]


def test_lookup_compile_backend():
    assert callable(compat.lookup_compile_backend("aot_eager"))
    graph = torch.fx.symbolic_trace(lambda x: x * 2)
    compiled = compat.lookup_compile_backend("eager")(graph, [torch.ones(2)])
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))


def test_dynamo_graphs_compiled_counts_a_graph_break_as_two_graphs():
    @torch.compiler.disable
    def eager(x):
        return x + 1

    def fn(x):
        return eager(x.sin()).cos()

    before = compat.dynamo_graphs_compiled()
    torch.compile(fn, backend="eager")(torch.ones(2))
    assert compat.dynamo_graphs_compiled() - before == 2  # sin; cos after the break


def test_disable_functorch_if_active():
    assert compat.disable_functorch_if_active(lambda x: x + 1)(1) == 2  # behaviour: test_transforms_and_recompute

    def fill(x: torch.Tensor) -> torch.Tensor:  # a buffer refilled from x, as fully_shard's copy-in
        buffer = torch.zeros(x.shape)
        buffer.copy_(x)
        return buffer

    x = torch.ones(2)
    # Inside torch.func.grad the copy is part of the transform's graph; with the transform
    # disabled the buffer is a plain tensor, a constant to it.
    assert torch.func.grad(lambda v: (fill(v) * v).sum())(x).tolist() == [2.0, 2.0]
    plain = compat.disable_functorch_if_active(fill)
    assert torch.func.grad(lambda v: (plain(v) * v).sum())(x).tolist() == [1.0, 1.0]


def test_module_parameters():
    linear = torch.nn.Linear(2, 2)
    assert compat.module_parameters(linear)["weight"] is linear.weight
    replacement = torch.nn.Parameter(torch.zeros(2, 2))
    compat.module_parameters(linear)["weight"] = replacement  # swapped in place, as fully_shard does
    assert linear.weight is replacement and dict(linear.named_parameters())["weight"] is replacement


def test_record_cuda_memory_history_and_dump_cuda_memory_snapshot(monkeypatch, tmp_path):
    """Called for real on a GPU; elsewhere through recorders put in place of torch's private
    functions (``monkeypatch.setattr`` fails if torch has no such name), with the arguments
    bound to the real functions' signatures."""
    if torch.cuda.is_available():
        compat.record_cuda_memory_history(100)
        torch.ones(1, device="cuda")
        compat.dump_cuda_memory_snapshot(str(tmp_path / "snapshot.pickle"))
        compat.record_cuda_memory_history(None)
        assert (tmp_path / "snapshot.pickle").stat().st_size > 0
        return
    calls = []
    for private in ("_record_memory_history", "_dump_snapshot"):
        real = inspect.signature(getattr(torch.cuda.memory, private))
        monkeypatch.setattr(torch.cuda.memory, private,
                            lambda *a, _real=real, _name=private, **kw: calls.append((_name, _real.bind(*a, **kw))))
    compat.record_cuda_memory_history(100)
    compat.dump_cuda_memory_snapshot(str(tmp_path / "snapshot.pickle"))
    compat.record_cuda_memory_history(None)
    assert [(name, bound.arguments) for name, bound in calls] == [
        ("_record_memory_history", {"max_entries": 100}),
        ("_dump_snapshot", {"filename": str(tmp_path / "snapshot.pickle")}),
        ("_record_memory_history", {"enabled": None}),
    ]


def test_post_accumulate_grad_hooks():
    param = torch.nn.Parameter(torch.ones(2))
    assert not compat.post_accumulate_grad_hooks(param)
    seen = []
    handle = param.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.tolist()))
    assert len(compat.post_accumulate_grad_hooks(param)) == 1
    (param * 3).sum().backward()
    assert seen == [[3.0, 3.0]]
    handle.remove()
    assert not compat.post_accumulate_grad_hooks(param)


def test_init_fake_process_group_stands_for_any_rank():
    assert not dist.is_initialized(), "a test left a process group behind"
    compat.init_fake_process_group(rank=4095, world_size=4096)
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (4095, 4096)
    finally:
        dist.destroy_process_group()


def test_compute_local_shape_and_global_offset(rank_2_of_4):
    # 10 rows over 4 ranks: 3, 3, 3, 1 (torch.chunk); rank 2 holds rows 6-8
    assert compat.compute_local_shape_and_global_offset((10, 3), rank_2_of_4, [Shard(0)]) == ((3, 3), (6, 0))
    assert compat.compute_local_shape_and_global_offset((10, 3), rank_2_of_4, [Replicate()]) == ((10, 3), (0, 0))


def test_dtensor_spec(rank_2_of_4):
    dtensor = _rows_6_to_8_of_10(rank_2_of_4)
    spec = compat.dtensor_spec(dtensor)
    assert isinstance(spec, compat.DTensorSpec) and isinstance(spec.tensor_meta, compat.TensorMeta)
    assert spec.mesh == rank_2_of_4 and spec.placements == (Shard(0),)
    assert (spec.tensor_meta.shape, spec.tensor_meta.stride, spec.tensor_meta.dtype) == ((10, 3), (3, 1), torch.float32)


def test_dtensor_spec_builds_a_dtensor(rank_2_of_4):
    """fully_shard makes its sharded parameters from a DTensorSpec and a TensorMeta."""
    meta = compat.TensorMeta(torch.Size((10, 3)), (3, 1), torch.float32)
    local = torch.ones(3, 3)
    dtensor = DTensor(local, compat.DTensorSpec(rank_2_of_4, (Shard(0),), tensor_meta=meta), requires_grad=False)
    assert dtensor.shape == (10, 3) and dtensor.placements == (Shard(0),) and compat.local_tensor(dtensor) is local


def test_local_tensor(rank_2_of_4):
    dtensor = _rows_6_to_8_of_10(rank_2_of_4)
    local = compat.local_tensor(dtensor)
    assert local is compat.local_tensor(dtensor) and local.data_ptr() == dtensor.to_local().data_ptr()
    assert local[:, 0].tolist() == [6.0, 7.0, 8.0]


def test_set_local_tensor(rank_2_of_4):
    dtensor = _rows_6_to_8_of_10(rank_2_of_4)
    replacement = torch.full((3, 3), 7.0)
    compat.set_local_tensor(dtensor, replacement)
    assert compat.local_tensor(dtensor) is replacement
    assert dtensor.to_local().data_ptr() == replacement.data_ptr() and torch.equal(dtensor.to_local(), replacement)
    assert dtensor.shape == (10, 3)


def test_unflatten_mesh(rank_2_of_4):
    mesh = compat.unflatten_mesh(init_device_mesh("cpu", (4,), mesh_dim_names=("shard",)), 0, (2, 2), ("a", "b"))
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]] and mesh.mesh_dim_names == ("a", "b")
    assert mesh["b"].mesh.tolist() == [2, 3] and mesh["a"].mesh.tolist() == [0, 2]


def test_mesh_dim_rank_groups():
    assert not dist.is_initialized(), "a test left a process group behind"
    compat.init_fake_process_group(rank=5, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "x"))
        assert compat.mesh_dim_rank_groups(mesh, 0) == [[0, 2, 4, 6], [1, 3, 5, 7]]
        assert compat.mesh_dim_rank_groups(mesh["x"], 0) == [[0, 1], [2, 3], [4, 5], [6, 7]]  # every rank's slice
        assert compat.mesh_dim_rank_groups(init_device_mesh("cpu", (8,)), 0) == [list(range(8))]
    finally:
        dist.destroy_process_group()


def test_package_imports_private_torch_names_only_through_compat():
    import pathlib
    import re

    compat_dir = pathlib.Path(compat.__file__).parent
    root = compat_dir.parent
    # private modules / functions of torch, and private attributes of torch objects
    private = re.compile(r"torch\._[a-zA-Z]|torch\.[a-z_.]+\._[a-z]|_execution_engine"
                         r"|\._(local_tensor|spec|parameters|register_[a-z_]+)\b")
    # rss_trace.py instruments torch's own FSDP2 internals on purpose (a diagnostic tracer)
    allowed = {"rss_trace.py"}
    repo = root.parent
    scope = [root, repo / "benchmarks", repo / "tests" / "checkpoint"]
    offenders = []
    for base in scope:
        for path in ([base] if base.is_file() else sorted(base.rglob("*.py"))):
            if path.name in allowed or compat_dir in path.parents:
                continue
            for lineno, line in enumerate(path.read_text().splitlines(), 1):
                if private.search(line) and not line.lstrip().startswith("#"):
                    offenders.append(f"{path.relative_to(repo)}:{lineno}: {line.strip()}")
    assert not offenders, "private torch names outside hyper_parallel/_torch_compat/:\n" + "\n".join(offenders)


def test_cpu_flash_attention_backward_is_sdpas_gradient():
    """cpu_flash_attention's (out, lse) and cpu_flash_attention_backward's gradients are SDPA's
    (grouped-query: 4 query heads over 2 key/value heads, causal)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 6, 8, generator=gen, dtype=torch.float64) for heads in (4, 2, 2))
    dout = torch.randn(2, 4, 6, 8, generator=gen, dtype=torch.float64)
    out, lse = compat.cpu_flash_attention(q, k, v, True, 0.3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.3, enable_gqa=True)
    ref.backward(dout)
    scores = (q.unflatten(1, (2, 2)) @ k.unsqueeze(2).transpose(-1, -2)).flatten(1, 2) * 0.3
    ref_lse = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf")).logsumexp(-1)
    assert (out - ref).abs().max() < 1e-12 and (lse - ref_lse).abs().max() < 1e-12
    grads = compat.cpu_flash_attention_backward(dout, q, k, v, out, lse, True, 0.3)
    assert max((g - leaf.grad).abs().max().item() for g, leaf in zip(grads, leaves)) < 1e-12


def test_cuda_efficient_attention_backward_on_meta_tensors():
    """cuda_efficient_attention and its backward resolve and take these arguments (meta tensors:
    shapes only; their numbers need a GPU)."""
    q = torch.empty(2, 4, 40, 8, device="meta")
    out, lse = compat.cuda_efficient_attention(q, q, q, True, 0.3)
    assert out.shape == q.shape and lse.shape == (2, 4, 64)  # lse rows padded to a multiple of 32
    grads = compat.cuda_efficient_attention_backward(out, q, q, q, out, lse, True, 0.3)
    assert [g.shape for g in grads] == [q.shape] * 3


def test_grouped_mm_and_grouped_mm_dtypes():
    assert torch.float32 in compat.grouped_mm_dtypes(torch.device("cpu"))
    assert torch.float64 not in compat.grouped_mm_dtypes(torch.device("cpu"))
    a, b = torch.randn(5, 8), torch.randn(2, 8, 4)
    out = compat.grouped_mm(a, b, offs=torch.tensor([2, 5], dtype=torch.int32))  # groups of 2 and 3 rows
    torch.testing.assert_close(out, torch.cat([a[:2] @ b[0], a[2:] @ b[1]]))


def test_cuda_flash_attention_backward_on_meta_tensors():
    """cuda_flash_attention (grouped-query K/V as they are) and its backward resolve and take
    these arguments (meta tensors: shapes only; their numbers need a GPU)."""
    q = torch.empty(2, 4, 40, 8, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 2, 40, 8, device="meta", dtype=torch.bfloat16)
    out, lse = compat.cuda_flash_attention(q, k, k, True, 0.3)
    assert out.shape == q.shape and (lse.shape, lse.dtype) == ((2, 4, 40), torch.float32)
    grads = compat.cuda_flash_attention_backward(out, q, k, k, out, lse, True, 0.3)
    assert [g.shape for g in grads] == [q.shape, k.shape, k.shape]


def test_cuda_flash_attention_applies_only_on_a_gpu_it_runs_on():
    assert not compat.cuda_flash_attention_applies(torch.device("cpu"))
    assert not compat.cuda_flash_attention_applies(torch.device("meta"))


def test_spmd_mesh_dims_and_shard_placement_result(rank_2_of_4):
    info = compat.FSDPMeshInfo(mesh=rank_2_of_4, shard_mesh_dim=0)
    assert compat.spmd_mesh_dims(info) is None
    result = compat.ShardPlacementResult(placement=Shard(0), mesh_info=info)
    assert (result.placement, result.mesh_info) == (Shard(0), info)


def test_all_gather_single_and_reduce_scatter_single(rank_2_of_4):
    group = rank_2_of_4.get_group()
    gathered, shard = torch.empty(8), torch.ones(2)
    assert compat.all_gather_single(gathered, shard, group=group) is None
    assert compat.all_gather_single(gathered, shard, group=group, async_op=True).wait()
    assert compat.reduce_scatter_single(shard, gathered, group=group) is None
    assert compat.reduce_scatter_single(shard, gathered, group=group, async_op=True).wait()


def test_module_buffers():
    norm = torch.nn.BatchNorm1d(3)
    assert compat.module_buffers(norm) is norm._buffers
    compat.module_buffers(norm)["running_mean"] = torch.ones(3)
    assert torch.equal(norm.running_mean, torch.ones(3))


def test_process_groups_lists_the_default_group_and_a_new_one_until_destroyed(rank_2_of_4):
    default = dist.distributed_c10d._get_default_group()
    assert compat.process_groups() == [default]
    group = dist.new_group([0, 1, 2, 3])
    assert compat.process_groups() == [default, group]
    dist.destroy_process_group(group)
    assert compat.process_groups() == [default]


def test_clear_dtensor_caches_stops_an_equal_mesh_getting_specs_of_a_destroyed_one(rank_2_of_4):
    def mesh_and_sum():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0), Shard(0)], run_check=False)
        return mesh, (x + x).device_mesh

    first, _ = mesh_and_sum()
    for group in compat.process_groups()[1:]:
        dist.destroy_process_group(group)
    compat.clear_dtensor_caches()
    second, result_mesh = mesh_and_sum()
    assert second == first and result_mesh is second


def test_register_pytree_node_lets_the_pipeline_split_a_chunked_loss():
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    from hyper_parallel.chunked_loss import ChunkedLoss  # registered through compat.register_pytree_node

    _, kwargs = split_args_kwargs_into_chunks((), {"loss": ChunkedLoss(torch.arange(8).view(4, 2), 2)}, 2)
    assert [k["loss"].chunks for k in kwargs] == [2, 2]
    assert [k["loss"].targets.tolist() for k in kwargs] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_pipeline_sum_reducer_sums_the_micro_batches_outputs():
    from torch.distributed.pipelining.microbatch import merge_chunks

    merged = merge_chunks([torch.tensor(1.5), torch.tensor(2.0)], compat.pipeline_sum_reducer())
    assert merged.item() == 3.5
