"""What a test leaves behind in module-level state of a reused rank process, and its reset.

The rank pool (``tests/multirank.py``) keeps its processes between tests, so without a reset a
test could pass only because an earlier one warmed a cache (or fail only after one did). After
every function a rank runs, :func:`reset_process_state` puts the caches back as a fresh process
has them. The default process group is kept (rebuilding it is what the pool exists to avoid);
the groups a test created (its meshes') are destroyed, with every cache that could hand a later
test a mesh built on them.
"""

from __future__ import annotations

from typing import Dict


def reset_process_state() -> None:
    """Wait for an async save still in flight, then clear the collective counters, the cached
    save plans, the staging buffers and the cached platform."""
    from hyper_parallel.core.distributed_checkpoint import api as checkpoint_api
    from hyper_parallel.core.fully_shard import collectives
    from hyper_parallel.platform import reset_platform

    checkpoint_api.wait_for_pending_save()
    checkpoint_api._PLANS.clear()
    checkpoint_api.staging_buffers().release()
    collectives.reset_collective_counts()
    reset_platform()
    destroy_test_process_groups()


def destroy_test_process_groups() -> None:
    """Destroy every process group but the default one (a gloo group keeps two threads per peer:
    left over from hundreds of tests they crowded the CPU), the library's caches of groups and
    meshes, and DTensor's caches keyed by meshes equal to the destroyed ones."""
    import torch.distributed as dist

    from hyper_parallel import _torch_compat as compat
    from hyper_parallel.core.fully_shard import mesh

    if not dist.is_initialized():
        return
    default = dist.distributed_c10d._get_default_group()
    for group in compat.process_groups():
        if group is not default:
            dist.destroy_process_group(group)
    mesh._SUBGROUPS.clear()
    mesh._WORLD_MESH.clear()
    compat.clear_dtensor_caches()


def process_state() -> Dict[str, int]:
    """Sizes of the state :func:`reset_process_state` clears (all zero after it)."""
    import torch.distributed as dist

    from hyper_parallel import _torch_compat as compat
    from hyper_parallel.core.distributed_checkpoint import api as checkpoint_api
    from hyper_parallel.core.fully_shard import collectives

    return {"test_process_groups": len(compat.process_groups()) - dist.is_initialized(),
            "collective_counts": sum(collectives.collective_counts().values()),
            "cached_save_plans": len(checkpoint_api._PLANS),
            "staging_bytes": checkpoint_api.staging_buffers().nbytes}
