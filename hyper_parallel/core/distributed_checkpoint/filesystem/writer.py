"""``FileSystemWriter``: a save's files, written into the pending directory and committed.

Layout of a committed checkpoint directory::

    metadata.json               written last; its presence is what makes it a checkpoint
    __{rank}_{i}.safetensors    tensor chunks written by ``rank`` (one file per I/O thread)
    __{rank}.values.json        that rank's non-tensor values (a JSON object)
    __{rank}.values.pkl         pickled values, only with ``allow_pickle=True``

How a save becomes a committed checkpoint (pending directory, rank-local metadata, async
markers) is ``commit.py``; the data files are written by ``data_files.py``; reading them
back is ``reader.py``.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List, Optional

from hyper_parallel.core.distributed_checkpoint._fileio import local_path
from hyper_parallel.utils.fileio import fsync_dir
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.filesystem import commit
from hyper_parallel.core.distributed_checkpoint.encoding.data_files import rank_data_files
from hyper_parallel.core.distributed_checkpoint.encoding.results import record_results
from hyper_parallel.core.distributed_checkpoint.filesystem.data_files import write_safetensors, write_values
from hyper_parallel.core.distributed_checkpoint.format.metadata import Metadata
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, SavePlanner
from hyper_parallel.core.distributed_checkpoint.storage import (
    AsyncCommitWriter,
    ChunkSource,
    DirectChunks,
    RankWriteResult,
)


class FileSystemWriter(AsyncCommitWriter):
    """Writes a checkpoint directory of safetensors files.

    Args:
        path: the checkpoint directory (or pass ``checkpoint_id`` to ``save``).
        thread_count: files (and I/O threads) per rank for tensor data.
        sync_files: fsync every file and directory before committing.
        allow_pickle: store values JSON cannot hold by pickling them (readers must opt in too).
        commit_timeout_s: how long an async save waits for the other ranks' files.
    """

    def __init__(self, path: Optional[str] = None, *, thread_count: int = 1, sync_files: bool = True,
                 allow_pickle: bool = False, commit_timeout_s: float = 1800.0) -> None:
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        self.path = None if path is None else local_path(path)
        self.thread_count, self.sync_files = thread_count, sync_files
        self.allow_pickle, self.commit_timeout_s = allow_pickle, commit_timeout_s
        self.is_coordinator, self.rank, self.world_size, self.use_collectives = True, 0, 1, True

    def initialize_writer(self, checkpoint_id: Optional[str]) -> None:
        if checkpoint_id is not None:
            self.path = local_path(checkpoint_id)
        if not self.path:
            raise ValueError("no checkpoint path: pass checkpoint_id or FileSystemWriter(path)")
        self.path = os.path.abspath(self.path)

    def configure_writer(self, is_coordinator: bool, *, rank: int = 0, world_size: int = 1,
                         use_collectives: bool = True, **kwargs: Any) -> None:
        self.is_coordinator, self.rank, self.world_size = is_coordinator, rank, world_size
        self.use_collectives = use_collectives
        if not use_collectives and commit.has_committed_metadata(self.path, rank):
            raise CheckpointError(
                f"{self.path} already holds a checkpoint; a save with use_collectives=False cannot "
                "replace it atomically: choose a new checkpoint_id"
            )

    def optimize_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        """Coordinator: create this save's pending directory."""
        os.makedirs(commit.pending_dir(self.path, plans[0].save_id))
        return plans

    def _target_dir(self, plan: SavePlan) -> str:
        return commit.pending_dir(self.path, plan.save_id) if self.use_collectives else self.path

    def execute_write(self, plan: SavePlan, planner: SavePlanner) -> RankWriteResult:
        directory = self._target_dir(plan)
        os.makedirs(directory, exist_ok=True)
        if self.use_collectives:  # lets async saves' waiting ranks notice if this process dies
            commit.start_heartbeat(directory, self.rank, self.commit_timeout_s)
        # Snapshotted saves stream tensor bytes from the snapshot's copy stages (host_memory/snapshot.py).
        source = planner if isinstance(planner, ChunkSource) else DirectChunks(planner)
        jobs = []
        for file in rank_data_files(plan, self.rank, self.thread_count, self.allow_pickle):
            if file.encoding is None:
                jobs.append((write_safetensors, file.name, file.items, source, ()))
            else:
                jobs.append((write_values, file.name, file.items, planner, (file.encoding,)))
        result = RankWriteResult([], {})

        def run(job):
            fn, name, items, data, extra = job
            # no-collective saves land in the live directory: write aside, then rename.
            final = os.path.join(directory, name)
            path = final if self.use_collectives else final + ".tmp"
            out = fn(path, items, data, name, *extra, self.sync_files)
            if path != final:
                os.replace(path, final)
            return out

        if len(jobs) > 1 and self.thread_count > 1:
            with ThreadPoolExecutor(min(self.thread_count, len(jobs))) as pool:
                outputs = list(pool.map(run, jobs))
        else:
            outputs = [run(job) for job in jobs]
        for (_, name, _, _, _), (items, info) in zip(jobs, outputs):
            result.items.extend(items)
            result.files[name] = info
        if self.sync_files and not self.use_collectives:
            fsync_dir(directory)  # collective saves: the coordinator fsyncs the pending dir once
        return result

    def finalize_checkpoint(self, metadata: Metadata, results: List[RankWriteResult]) -> None:
        record_results(metadata, results)
        if not self.use_collectives:
            metadata.rank = self.rank
            commit.commit_rank_metadata(self.path, metadata, self.sync_files)
        else:
            commit.commit_pending_dir(commit.pending_dir(self.path, metadata.save_id), self.path, metadata,
                                      self.sync_files)

    def abort_checkpoint(self, plan: SavePlan) -> None:
        """Remove the pending directory of a failed collective save."""
        if self.use_collectives and plan.save_id:
            shutil.rmtree(self._target_dir(plan), ignore_errors=True)

    # --- commit without collectives, for async saves (commit.py) -------------------------

    def publish_result(self, plan: SavePlan, result: RankWriteResult) -> None:
        commit.publish_result(self._target_dir(plan), self.rank, result)

    def publish_failure(self, plan: SavePlan, error: BaseException) -> None:
        commit.publish_failure(self._target_dir(plan), self.rank, error)

    def collect_results(self, plan: SavePlan) -> List[RankWriteResult]:
        return commit.collect_results(self._target_dir(plan), self.path, self.world_size, self.commit_timeout_s)

    def wait_committed(self, plan: SavePlan) -> Metadata:
        return commit.wait_committed(self._target_dir(plan), self.path, plan.save_id, self.commit_timeout_s)

