"""Every private torch name hyper_parallel uses resolves on the installed torch."""

from __future__ import annotations

import torch

from hyper_parallel import _torch_compat as compat


def test_every_name_resolves_and_behaves():
    for name in compat.__all__:
        assert getattr(compat, name) is not None, name
    a, b = torch.arange(4.0).view(2, 2), torch.arange(4.0, 6.0).view(2, 1)
    # rank-major chunks: rank 0 gets row 0 of each tensor, rank 1 row 1
    assert compat.chunk_cat([a, b], dim=0, num_chunks=2).tolist() == [[0, 1, 4], [2, 3, 5]]
    t = torch.ones(2)
    compat.foreach_mul_([t], torch.tensor(3.0))
    assert t.tolist() == [3.0, 3.0]
    version = t._version
    with compat.preserve_version_counter(t):
        t.add_(1)
    assert t._version == version
    assert compat.current_graph_task_id() == -1  # outside backward
    seen = []
    x = torch.ones(1, requires_grad=True)
    x.register_hook(lambda g: compat.queue_autograd_callback(lambda: seen.append(compat.current_graph_task_id())))
    (x * 2).sum().backward()
    assert len(seen) == 1 and seen[0] != -1
    assert callable(compat.lookup_compile_backend("aot_eager"))
    assert callable(compat.record_cuda_memory_history) and callable(compat.dump_cuda_memory_snapshot)
    assert compat.disable_functorch_if_active(lambda x: x + 1)(1) == 2  # behaviour: test_transforms_and_recompute
    linear = torch.nn.Linear(2, 2)
    assert compat.module_parameters(linear)["weight"] is linear.weight


def test_fake_process_group_stands_for_any_rank():
    import torch.distributed as dist

    assert not dist.is_initialized(), "a test left a process group behind"
    compat.init_fake_process_group(rank=4095, world_size=4096)
    try:
        assert (dist.get_rank(), dist.get_world_size()) == (4095, 4096)
    finally:
        dist.destroy_process_group()


def test_package_imports_private_torch_names_only_through_compat():
    import pathlib
    import re

    root = pathlib.Path(compat.__file__).parent
    # private modules / functions of torch, and private attributes of torch objects
    private = re.compile(r"torch\._[a-zA-Z]|torch\.[a-z_.]+\._[a-z]|_execution_engine"
                         r"|\._(local_tensor|spec|parameters|register_[a-z_]+)\b")
    # rss_trace.py instruments torch's own FSDP2 internals on purpose (a diagnostic tracer)
    allowed = {"_torch_compat.py", "rss_trace.py"}
    repo = root.parent
    scope = [root, repo / "benchmarks", repo / "tests" / "checkpoint"]
    offenders = []
    for base in scope:
        for path in ([base] if base.is_file() else sorted(base.rglob("*.py"))):
            if path.name in allowed:
                continue
            for lineno, line in enumerate(path.read_text().splitlines(), 1):
                if private.search(line) and not line.lstrip().startswith("#"):
                    offenders.append(f"{path.relative_to(repo)}:{lineno}: {line.strip()}")
    assert not offenders, "private torch names outside _torch_compat.py:\n" + "\n".join(offenders)
