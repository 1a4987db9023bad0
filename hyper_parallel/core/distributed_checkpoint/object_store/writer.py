"""``FsspecWriter``: a save's objects on an fsspec file system, committed by writing the
metadata object last (the protocol is ``store.py``'s)."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.encoding.data_files import (
    DataFile,
    encode_values,
    rank_data_files,
    stream_safetensors,
)
from hyper_parallel.core.distributed_checkpoint.encoding.results import (
    DoneMarkers,
    record_results,
    results_from_json,
    results_to_json,
)
from hyper_parallel.core.distributed_checkpoint.format.metadata import METADATA_FILE, Metadata
from hyper_parallel.core.distributed_checkpoint.object_store import lease, store
from hyper_parallel.core.distributed_checkpoint.planner import SavePlan, SavePlanner
from hyper_parallel.core.distributed_checkpoint.storage import (
    AsyncCommitWriter,
    ChunkSource,
    DirectChunks,
    RankWriteResult,
)

UPLOAD_PART_BYTES = 64 << 20
"""Bytes buffered per upload part: large files go up as concurrent multipart uploads (s3fs)."""
_log = logging.getLogger(__name__)


class FsspecWriter(AsyncCommitWriter):
    """Writes a checkpoint under an fsspec URL (``s3://bucket/run/step-100``, ``memory://...``).

    Args:
        url: the checkpoint's prefix (or pass ``checkpoint_id`` to ``save``).
        thread_count: objects (and upload threads) per rank for tensor data.
        allow_pickle: store values JSON cannot hold by pickling them (readers must opt in too).
        commit_timeout_s: how long an async save waits for the other ranks' objects.
        storage_options: fsspec options of the file system (on top of its own configuration).
    """

    def __init__(self, url: Optional[str] = None, *, thread_count: int = 1, allow_pickle: bool = False,
                 commit_timeout_s: float = 1800.0, storage_options: Optional[Dict[str, Any]] = None) -> None:
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        self.url, self.thread_count, self.allow_pickle = url, thread_count, allow_pickle
        self.commit_timeout_s, self.storage_options = commit_timeout_s, storage_options
        self.fs: Any = None
        self.path = ""
        self.rank, self.world_size = 0, 1

    def initialize_writer(self, checkpoint_id: Optional[str]) -> None:
        self.url, self.fs, self.path = store.open_checkpoint(checkpoint_id, self.url, self.storage_options,
                                                             type(self).__name__)

    def configure_writer(self, is_coordinator: bool, *, rank: int = 0, world_size: int = 1,
                         use_collectives: bool = True, **kwargs: Any) -> None:
        if not use_collectives:
            raise ValueError(f"{self.url}: saves with use_collectives=False are not supported on object "
                             "storage (each rank's metadata would need a commit of its own)")
        self.rank, self.world_size = rank, world_size

    def _object(self, name: str) -> str:
        return f"{self.path}/{name}"

    def _upload(self, file: DataFile, source: ChunkSource, planner: SavePlanner):
        if file.encoding is not None:
            results, blob, info = encode_values(file.items, planner, file.name, file.encoding)
            self.fs.pipe_file(self._object(file.name), blob)
            return results, info
        with self.fs.open(self._object(file.name), "wb", block_size=UPLOAD_PART_BYTES) as f:
            return stream_safetensors(f, file.items, source, file.name)

    def execute_write(self, plan: SavePlan, planner: SavePlanner) -> RankWriteResult:
        if store.is_local(self.fs):  # object stores have no directories to create
            self.fs.makedirs(self.path, exist_ok=True)
        source = planner if isinstance(planner, ChunkSource) else DirectChunks(planner)
        files = rank_data_files(plan, self.rank, self.thread_count, self.allow_pickle, f".{plan.save_id}")
        if len(files) > 1 and self.thread_count > 1:
            with ThreadPoolExecutor(min(self.thread_count, len(files)), "hyper_parallel-upload") as pool:
                outputs = list(pool.map(lambda f: self._upload(f, source, planner), files))
        else:
            outputs = [self._upload(f, source, planner) for f in files]
        result = RankWriteResult([], {})
        for file, (items, info) in zip(files, outputs):
            result.items.extend(items)
            result.files[file.name] = info
        return result

    def finalize_checkpoint(self, metadata: Metadata, results: List[RankWriteResult]) -> None:
        """Write the metadata object (the commit point), then delete other saves' objects. In a
        folder whose lease this process holds, the lease is confirmed right before each of the
        two (``lease.fence``): a job that lost it commits and deletes nothing.

        Raises:
            CheckpointError: the folder's lease was taken over by another job (not committed).
        """
        record_results(metadata, results)
        lease.fence(self.url, f"commit {self.url}")
        store.put_atomically(self.fs, self._object(METADATA_FILE), metadata.to_json().encode())
        try:
            lease.fence(self.url, f"delete the objects of other saves under {self.url}")
        except CheckpointError as exc:  # committed already: raising would delete this save's objects
            _log.error("%s", exc)
            return
        store.remove_saves(self.fs, self.path, lambda save_id: save_id != metadata.save_id)

    def abort_checkpoint(self, plan: SavePlan) -> None:
        """Delete the objects of a failed save (the committed checkpoint, if any, stays)."""
        if plan.save_id:
            store.remove_saves(self.fs, self.path, lambda save_id: save_id == plan.save_id)

    # --- commit without collectives, for async saves: marker objects ----------------------

    def publish_result(self, plan: SavePlan, result: RankWriteResult) -> None:
        self.fs.pipe_file(self._object(store.DONE_MARKER.format(self.rank, plan.save_id)),
                          results_to_json(result).encode())

    def publish_failure(self, plan: SavePlan, error: BaseException) -> None:
        try:
            self.fs.pipe_file(self._object(store.FAILED_MARKER.format(self.rank, plan.save_id)), repr(error).encode())
        except Exception:  # best effort: the others time out instead
            pass

    def collect_results(self, plan: SavePlan) -> List[RankWriteResult]:
        markers = DoneMarkers({r: store.DONE_MARKER.format(r, plan.save_id) for r in range(self.world_size)})
        store.poll(self.fs, self.path, self.url, plan.save_id, self.commit_timeout_s, markers.seen,
                   markers.waiting_for)
        paths = [self._object(m) for m in markers.names]
        texts = self.fs.cat(paths)  # one batch: concurrent GETs on s3fs
        results = [results_from_json(texts[p].decode()) for p in paths]
        self.fs.rm(paths)
        return results

    def wait_committed(self, plan: SavePlan) -> Metadata:
        """Poll until the coordinator committed this save. The coordinator deletes this rank's
        done marker once it collected it, just before the commit: the metadata object is read
        only after that (a replaced checkpoint's old metadata is not re-read on every poll)."""
        committed: List[Metadata] = []
        marker = store.DONE_MARKER.format(self.rank, plan.save_id)

        def done(names: List[str]) -> bool:
            if marker in names or METADATA_FILE not in names:
                return False
            metadata = store.read_metadata(self.fs, self.path, self.url)
            if metadata.save_id == plan.save_id:
                committed.append(metadata)
                return True
            return False

        store.poll(self.fs, self.path, self.url, plan.save_id, self.commit_timeout_s, done,
                   lambda: "the coordinator did not commit")
        return committed[0]
