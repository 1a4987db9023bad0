"""The ``checkpoint.memory_*`` keys: snapshots of the training state in node-local host memory,
replicated to a partner rank, that a restarted job resumes from (``trainer/checkpointing/memory_snapshots.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List

from hyper_parallel.trainer.config.rules import key
from hyper_parallel.utils.fileio import url_scheme

DEFAULT_MEMORY_DIR = "/dev/shm/hyper_parallel"


@dataclass
class MemorySnapshotKeys:
    """The ``checkpoint`` group's in-memory snapshot keys (:class:`~.schema.CheckpointConfig` has them)."""

    memory_interval: int = key(0, min=0)                 # snapshot into host memory (and a partner's) every N steps; 0: off
    memory_dir: str = key(DEFAULT_MEMORY_DIR, path=True)  # node-local folder of the snapshots (tmpfs: outlives the ranks)

    def memory_problems(self, ok: Callable[[str], bool]) -> List[str]:
        """``memory_dir`` must be a local folder (a URL would become a folder named ``s3:``)."""
        if ok("memory_interval") and self.memory_interval and ok("memory_dir"):
            try:
                scheme = url_scheme(self.memory_dir)
            except ValueError as err:
                return [f"checkpoint.memory_dir: {err}"]
            if scheme:
                return [f"checkpoint.memory_dir={self.memory_dir} is a URL; snapshots live in a local folder "
                        "(host memory: a tmpfs such as /dev/shm)"]
        return []
