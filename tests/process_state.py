"""What a test leaves behind in module-level state of a reused rank process, and its reset.

The rank pool (``tests/multirank.py``) keeps its processes between tests, so without a reset a
test could pass only because an earlier one warmed a cache (or fail only after one did). After
every function a rank runs, :func:`reset_process_state` puts the caches back as a fresh process
has them; the process group and the meshes built on it are kept (rebuilding them is what the
pool exists to avoid, and they hold no test's data).
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


def process_state() -> Dict[str, int]:
    """Sizes of the state :func:`reset_process_state` clears (all zero after it)."""
    from hyper_parallel.core.distributed_checkpoint import api as checkpoint_api
    from hyper_parallel.core.fully_shard import collectives

    return {"collective_counts": sum(collectives.collective_counts().values()),
            "cached_save_plans": len(checkpoint_api._PLANS),
            "staging_bytes": checkpoint_api.staging_buffers().nbytes}
