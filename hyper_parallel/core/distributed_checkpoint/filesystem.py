"""``FileSystemWriter`` and ``FileSystemReader``: checkpoints as directories of safetensors files.

Layout of a committed checkpoint directory::

    metadata.json               written last; its presence is what makes it a checkpoint
    __{rank}_{i}.safetensors    tensor chunks written by ``rank`` (one file per I/O thread)
    __{rank}.values.json        that rank's non-tensor values (a JSON object)
    __{rank}.values.pkl         pickled values, only with ``allow_pickle=True``

How a save becomes a committed checkpoint (staging directory, rank-local metadata, async
markers) is ``commit.py``; the data files are written by ``data_files.py``.
"""

from __future__ import annotations

import functools
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, FrozenSet, List, Optional, Tuple


from hyper_parallel.core.distributed_checkpoint import commit
from hyper_parallel.core.distributed_checkpoint._fileio import flat_bytes, fsync_dir, local_path, read_exact
from hyper_parallel.core.distributed_checkpoint.bounce import BounceReads, read_box
from hyper_parallel.core.distributed_checkpoint.block_reads import BlockReads
from hyper_parallel.core.distributed_checkpoint.checksum import crc32
from hyper_parallel.core.distributed_checkpoint.commit import read_checkpoint_metadata
from hyper_parallel.core.distributed_checkpoint.data_files import split_by_bytes, write_safetensors, write_values
from hyper_parallel.core.distributed_checkpoint.metadata import (
    CheckpointError,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from hyper_parallel.core.distributed_checkpoint.resharding import BoxGeometry, numel
from hyper_parallel.core.distributed_checkpoint.staging import ChunkSource, DirectChunks
from hyper_parallel.core.distributed_checkpoint.staging_buffers import process_staging_buffers
from hyper_parallel.core.distributed_checkpoint.storage import (
    AsyncCommitWriter,
    RankWriteResult,
    StorageReader,
)
from hyper_parallel.core.distributed_checkpoint.validation import decode_stored_value, open_data_file
from hyper_parallel.core.distributed_checkpoint.verify_plan import (
    assign_duties,
    duties_of,
    mark_local_plan,
    reads_whole,
)
from hyper_parallel.platform import get_platform


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
        """Coordinator: create this save's staging directory."""
        os.makedirs(commit.staging_dir(self.path, plans[0].save_id))
        return plans

    def _target_dir(self, plan: SavePlan) -> str:
        return commit.staging_dir(self.path, plan.save_id) if self.use_collectives else self.path

    def execute_write(self, plan: SavePlan, planner: SavePlanner) -> RankWriteResult:
        directory = self._target_dir(plan)
        os.makedirs(directory, exist_ok=True)
        if self.use_collectives:  # lets async saves' waiting ranks notice if this process dies
            commit.start_heartbeat(directory, self.rank, self.commit_timeout_s)
        tensors = [it for it in plan.items if it.type == WriteItemType.TENSOR]
        values: Dict[str, List[WriteItem]] = {}
        for it in plan.items:
            if it.type == WriteItemType.BYTE_IO:
                values.setdefault(it.bytes_io_data.encoding, []).append(it)
        if "pickle" in values and not self.allow_pickle:
            raise ValueError(f"{values['pickle'][0].index.fqn!r} needs pickling; pass allow_pickle=True")
        # Staged saves stream tensor bytes from the staging pipeline (staging.py).
        source = planner if isinstance(planner, ChunkSource) else DirectChunks(planner)
        jobs = []
        for i, bucket in enumerate(split_by_bytes(tensors, self.thread_count)):
            jobs.append((write_safetensors, f"__{self.rank}_{i}.safetensors", bucket, source, ()))
        for encoding, items in values.items():
            name = f"__{self.rank}.values.{'json' if encoding == 'json' else 'pkl'}"
            jobs.append((write_values, name, items, planner, (encoding,)))
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
            fsync_dir(directory)  # collective saves: the coordinator fsyncs the staging dir once
        return result

    def finalize_checkpoint(self, metadata: Metadata, results: List[RankWriteResult]) -> None:
        commit.record_results(metadata, results)
        if not self.use_collectives:
            metadata.rank = self.rank
            commit.commit_rank_metadata(self.path, metadata, self.sync_files)
        else:
            commit.commit_staging_dir(commit.staging_dir(self.path, metadata.save_id), self.path, metadata,
                                      self.sync_files)

    def abort_checkpoint(self, plan: SavePlan) -> None:
        """Remove the staging directory of a failed collective save."""
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


_SPAN_GAP_BYTES = 8 << 10
"""A box whose pieces lie less than this many bytes apart (on average) is read as whole rows and
copied out in memory: a syscall per piece (~3 us) costs more than copying the gap (measured by
``benchmarks/piece_reads.py``). The disk and the page cache read whole pages and readahead
windows either way."""


class FileSystemReader(StorageReader):
    """Reads a checkpoint directory, fetching only the byte ranges each rank needs.

    Args:
        checkpoint_dir: the checkpoint directory (or pass ``checkpoint_id`` to ``load``).
        verify: check every stored chunk a rank uses against its crc32 in the metadata (the
            default; ``load(..., verify=False)`` or ``verify=False`` here turns it off). A chunk
            needed whole is checked as it is read; one that several ranks need parts of is read
            whole and checked by one of them (``verify_plan.py``).
        allow_pickle: accept pickled values (only for checkpoints you trust).
        thread_count: tensor reads in flight at once on this rank.
    """

    def __init__(self, checkpoint_dir: Optional[str] = None, *, verify: bool = True,
                 allow_pickle: bool = False, thread_count: int = 1) -> None:
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        self.path = None if checkpoint_dir is None else local_path(checkpoint_dir)
        self.verify, self.allow_pickle, self.thread_count = verify, allow_pickle, thread_count
        self.metadata: Optional[Metadata] = None
        self._verifying = verify

    def initialize_reader(self, checkpoint_id: Optional[str]) -> None:
        if checkpoint_id is not None:
            self.path = local_path(checkpoint_id)
        if not self.path:
            raise ValueError("no checkpoint path: pass checkpoint_id or FileSystemReader(path)")

    def read_metadata(self) -> Metadata:
        """The checkpoint's metadata; works without a process group."""
        return read_checkpoint_metadata(self.path)

    def load_metadata(self, **kwargs: Any) -> Metadata:
        return self.read_metadata()

    def configure_reader(self, metadata: Metadata, is_coordinator: bool, **kwargs: Any) -> None:
        self.metadata = metadata
        self._verifying = self.verify and bool(kwargs.get("verify", True))

    def optimize_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return mark_local_plan(plan, self._verifying)

    def optimize_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        """Coordinator: assign the checks of chunks that ranks read only parts of."""
        chunk_bytes = {}
        for plan in plans:
            for item in plan.items:
                if item.type == LoadItemType.TENSOR and item.storage_index not in chunk_bytes:
                    md = self.metadata.state_dict_metadata[item.storage_index.fqn]
                    chunk_bytes[item.storage_index] = (self._storage(item.storage_index).length, md.dtype.itemsize)
        return assign_duties(plans, chunk_bytes)

    def _open(self, name: str) -> int:
        return open_data_file(self.path, name, self.metadata)

    def _storage(self, index: MetadataIndex) -> StorageInfo:
        info = self.metadata.storage_data.get(index)
        if info is None:
            raise CheckpointError(f"checkpoint metadata has no storage location for {index}")
        return info

    def _check(self, crc: int, info: StorageInfo, what: str) -> None:
        if crc != info.checksum:
            raise CheckpointError(
                f"checksum mismatch in {os.path.join(self.path, info.relative_path)} bytes "
                f"{info.offset}..{info.offset + info.length} ({what}): the file is corrupt"
            )

    def execute_read(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Read every item of ``plan``; with ``thread_count > 1`` several tensor reads are in
        flight at once (``planner.apply_tensor`` is then called from several threads, each
        for a different destination box)."""
        located = [(self._storage(item.storage_index), item) for item in plan.items]
        fds: Dict[str, int] = {}
        try:
            for info, _ in located:
                if info.relative_path not in fds:
                    fds[info.relative_path] = self._open(info.relative_path)
            located.sort(key=lambda pair: (pair[0].relative_path, pair[0].offset))
            tensors = []
            for info, item in located:
                if item.type == LoadItemType.BYTE_IO:
                    planner.apply_bytes(item, self._read_value(fds[info.relative_path], info, item.storage_index.fqn))
                else:
                    tensors.append((info, item))

            duties = duties_of(plan)
            # The current device and stream are per thread: take the caller's here. Every reader
            # thread's copy stream is built here (ordered after the caller's stream), and the
            # readers share one window of slabs (bounce.py: they cannot wait on each other).
            platform, pool = get_platform(), process_staging_buffers()
            device, window = platform.current_device(), pool.window(snapshot=False)
            threads = min(self.thread_count, len(tensors))
            bounces = [BounceReads(pool, window, planner, device) for _ in range(max(threads, 1))]

            def read(group: List[Tuple[StorageInfo, ReadItem]], bounce: BounceReads) -> None:
                platform.use_device(device)
                blocks = BlockReads()
                try:
                    for info, item in group:
                        self._read_tensor(fds[info.relative_path], info, item, planner, bounce, blocks, duties)
                    blocks.settle()
                finally:
                    blocks.close()
                    bounce.finish()

            if threads > 1:
                with ThreadPoolExecutor(threads, thread_name_prefix="hyper_parallel-read") as pool_threads:
                    list(pool_threads.map(read, [tensors[i::threads] for i in range(threads)], bounces))
            else:
                read(tensors, bounces[0])
            for bounce in bounces:  # the caller's later work follows the copies
                bounce.make_current_wait()
        finally:
            for fd in fds.values():
                os.close(fd)

    def _read_value(self, fd: int, info: StorageInfo, key: str) -> Any:
        data = bytearray(info.length)
        read_exact(fd, data, info.offset, os.path.join(self.path, info.relative_path))
        if self._verifying:
            self._check(crc32(data), info, key)
        return decode_stored_value(bytes(data), info.encoding, key, allow_pickle=self.allow_pickle)

    def _read_tensor(self, fd: int, info: StorageInfo, item: ReadItem, planner: LoadPlanner,
                     bounce: BounceReads, blocks: BlockReads, duties: Optional[FrozenSet[MetadataIndex]]) -> None:
        key = item.storage_index.fqn
        md = self.metadata.state_dict_metadata[key]
        sizes = md.chunks.sizes_at(item.storage_index.offset) if isinstance(md, TensorStorageMetadata) else None
        if sizes is None or numel(sizes) * md.dtype.itemsize != info.length:
            raise CheckpointError(f"checkpoint metadata of {key!r} chunk {item.storage_index.offset} is inconsistent")
        path = os.path.join(self.path, info.relative_path)
        dest = planner.acquire_tensor(item)
        plain = dest.is_contiguous() and dest.device.type == "cpu" and dest.dtype == md.dtype
        whole = reads_whole(item, sizes)
        if self._verifying and (whole or duties is None or item.storage_index in duties):
            # The checksum covers the whole chunk, so read it whole: straight into the
            # destination when that is the whole chunk in plain memory. Checked (then applied)
            # once its crc is known, while the next chunk is read.
            # Destinations not filled in place (device memory, strided, another dtype) get
            # their boxes through the bounce slabs and the copy stream, as unchecked reads do.
            def then(crc: int) -> None:
                self._check(crc, info, f"{key} chunk {item.storage_index.offset}")
                if plain:
                    planner.apply_tensor(item, dest)
                else:
                    bounce.apply_after_copies(item, dest)

            if whole and plain:
                blocks.read_into(fd, flat_bytes(dest), info.offset, path, then)
            else:
                copy = None if plain else functools.partial(bounce.copy, key=key)
                blocks.read_box(fd, info.offset, sizes, item, dest, md.dtype, path, then, copy)
        elif plain:  # not checked here: verify=False, or another rank checks this chunk
            box = BoxGeometry(sizes, item.storage_offsets, item.lengths)
            if box.contiguous or (box.span - box.volume) * box.run * md.dtype.itemsize >= _SPAN_GAP_BYTES * box.volume:
                read_box(fd, dest, box, info.offset, md.dtype.itemsize, path)  # straight into plain memory
            else:  # many pieces with small gaps: a few large reads of their rows beat a syscall each
                blocks.read_rows(fd, info.offset, sizes, item, dest, md.dtype, path)
            planner.apply_tensor(item, dest)
        else:
            bounce.read(fd, path, info.offset, sizes, item, dest, md.dtype)
