"""Shared by the checkpoint scripts: accept a checkpoint or a folder of ``step-N`` checkpoints
(``resolve_checkpoint``, from the package, as the CLI does)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hyper_parallel.checkpoint import resolve_checkpoint  # noqa: E402

__all__ = ["resolve_checkpoint"]
