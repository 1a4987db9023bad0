"""Shared by the checkpoint scripts: accept a checkpoint or a folder of ``step-N`` checkpoints."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hyper_parallel.checkpoint import CheckpointError, is_checkpoint  # noqa: E402
from hyper_parallel.core.distributed_checkpoint.manager import checkpoint_step  # noqa: E402


def resolve_checkpoint(path: str) -> str:
    """``path`` itself if it is a committed checkpoint, else its newest committed ``step-N``.

    Raises:
        CheckpointError: neither (the message says what was found).
    """
    if is_checkpoint(path):
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint or folder")
    steps = sorted((s, name) for name in os.listdir(path)
                   if (s := checkpoint_step(name)) is not None and is_checkpoint(os.path.join(path, name)))
    if not steps:
        raise CheckpointError(f"{path} is neither a committed checkpoint nor a folder holding step-N checkpoints")
    return os.path.join(path, steps[-1][1])
