"""This process's rank and world size, with or without a process group."""

from __future__ import annotations

from typing import Tuple

import torch.distributed as dist


def dist_ready() -> bool:
    """Whether the default process group exists (torch.distributed built and initialised)."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world(use_dist: bool = True) -> Tuple[int, int]:
    """``(rank, world size)`` in the default process group; ``(0, 1)`` without one, or when
    ``use_dist`` is False (a process working alone). Not the launcher's ``RANK`` before the
    group exists: that is ``get_platform().rank``."""
    if use_dist and dist_ready():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
