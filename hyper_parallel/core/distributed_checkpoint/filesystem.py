"""Checkpoints as directories of safetensors files plus ``metadata.json``, committed atomically.

Layout of a committed checkpoint directory::

    metadata.json               written last; its presence is what makes it a checkpoint
    __{rank}_{i}.safetensors    tensor chunks written by ``rank`` (one file per I/O thread)
    __{rank}.values.json        that rank's non-tensor values (a JSON object)
    __{rank}.values.pkl         pickled values, only with ``allow_pickle=True``

A collective save writes into ``.{name}.staging-{save_id}`` next to the target, then the
coordinator writes ``metadata.json`` there and swaps the directory into place. A save with
``use_collectives=False`` writes straight into the target and each rank commits its own
``metadata.rank{r}.json``; the directory is a checkpoint once all ranks have.
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import shutil
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from hyper_parallel.core.distributed_checkpoint.checksum import crc32_combine
from hyper_parallel.core.distributed_checkpoint.metadata import (
    DTYPE_TO_SAFETENSORS,
    METADATA_FILE,
    CheckpointError,
    FileInfo,
    Metadata,
    MetadataIndex,
    StorageInfo,
    TensorStorageMetadata,
    check_relative_path,
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
from hyper_parallel.core.distributed_checkpoint.resharding import numel
from hyper_parallel.core.distributed_checkpoint.storage import (
    RankWriteResult,
    StorageReader,
    StorageWriter,
    WriteResult,
)
from hyper_parallel.core.distributed_checkpoint.values import decode_value

_RANK_METADATA = "metadata.rank{}.json"
_DONE_MARKER = ".done.rank{}.json"
_FAILED_MARKER = ".failed.rank{}"


# ----------------------------------------------------------------------------- file helpers

def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file_atomically(path: str, data: bytes, sync: bool = True) -> None:
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def _load_sync_file_range():
    try:
        sync_file_range = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)
    except (OSError, TypeError):  # no C library handle for this process (e.g. Windows)
        return None
    if sync_file_range is not None:
        sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return sync_file_range


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing a just-written byte range of ``fd`` to disk without waiting (Linux
    ``sync_file_range``; elsewhere a no-op and the final fsync does all the work)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def _flat_bytes(tensor: torch.Tensor):
    """The bytes of a contiguous CPU tensor as a uint8 numpy array sharing its memory."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def _exchange_dirs(a: str, b: str) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where unsupported."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _replace_dir(staging: str, final: str) -> None:
    """Move ``staging`` to ``final``, replacing an existing ``final`` atomically where the
    OS allows (Linux renameat2); elsewhere the old one is moved aside first."""
    if not os.path.lexists(final):
        os.rename(staging, final)
    elif not os.path.isdir(final) or os.path.islink(final):
        raise CheckpointError(f"cannot save checkpoint to {final}: it exists and is not a directory")
    elif _exchange_dirs(staging, final):
        shutil.rmtree(staging)
    else:
        aside = f"{staging}.old"
        os.rename(final, aside)
        os.rename(staging, final)
        shutil.rmtree(aside)
    _fsync_dir(os.path.dirname(os.path.abspath(final)))


def _read_exact(fd: int, buffer, offset: int, path: str) -> None:
    view = memoryview(buffer).cast("B")
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise CheckpointError(
                f"{path} is truncated: needed bytes {offset}..{offset + len(view)} but the file ends "
                f"at {offset + done}"
            )
        done += n


# ----------------------------------------------------------------------- safetensors writing

def _tensor_name(index: MetadataIndex) -> str:
    name = index.fqn + "@" + ",".join(str(o) for o in index.offset)
    return name if index.index is None else f"{name}#{index.index}"


def _safetensors_header(entries: List[Tuple[str, torch.dtype, Tuple[int, ...], int]]) -> bytes:
    header: Dict[str, Any] = {"__metadata__": {"format": "pt", "writer": "hyper_parallel"}}
    start = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": DTYPE_TO_SAFETENSORS[dtype], "shape": list(shape),
                        "data_offsets": [start, start + nbytes]}
        start += nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)  # data section starts 8-byte aligned
    return len(body).to_bytes(8, "little") + body


def _write_safetensors(path: str, items: List[WriteItem], planner: SavePlanner, name: str,
                       sync: bool) -> Tuple[List[WriteResult], FileInfo]:
    # The header comes from the plan, so each chunk is fetched (and copied to CPU) only when written.
    entries = [(_tensor_name(it.index), it.tensor_data.dtype, it.tensor_data.chunk.sizes,
                numel(it.tensor_data.chunk.sizes) * it.tensor_data.dtype.itemsize) for it in items]
    header = _safetensors_header(entries)
    results, offset = [], len(header)
    file_crc = zlib.crc32(header)
    known_checksum = getattr(planner, "known_checksum", None)
    # zlib.crc32 and file writes both release the GIL: checksum each chunk on a helper
    # thread while this one writes it, so the checksum costs no extra wall time.
    with open(path, "wb") as f, ThreadPoolExecutor(1, thread_name_prefix="hyper_parallel-crc") as crc_pool:
        f.write(header)
        for item, (_, _, shape, nbytes) in zip(items, entries):
            tensor = planner.get_data(item).detach().cpu().contiguous()
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != item.tensor_data.dtype:
                raise CheckpointError(f"{item.index.fqn!r} changed shape or dtype between planning and writing")
            data = _flat_bytes(tensor)
            crc = known_checksum(item) if known_checksum is not None else None
            pending = crc_pool.submit(zlib.crc32, data) if crc is None else None
            f.write(data)
            if sync:
                # Disk writes overlap the copying of the next chunks instead of all waiting
                # for the final fsync.
                f.flush()
                start_writeback(f.fileno(), offset, nbytes)
            if pending is not None:
                crc = pending.result()
            file_crc = crc32_combine(file_crc, crc, nbytes)
            results.append(WriteResult(item.index, StorageInfo(name, offset, nbytes, crc)))
            offset += nbytes
        f.flush()
        if sync:
            os.fsync(f.fileno())
    return results, FileInfo(offset, file_crc)


def _write_values(path: str, items: List[WriteItem], planner: SavePlanner, name: str, encoding: str,
                  sync: bool) -> Tuple[List[WriteResult], FileInfo]:
    # JSON values form one JSON object {fqn: value}; pickles are concatenated.
    json_file = encoding == "json"
    parts: List[bytes] = [b"{"] if json_file else []
    results, offset = [], len(parts[0]) if parts else 0
    for i, item in enumerate(items):
        if json_file:
            prefix = (b"," if i else b"") + json.dumps(item.index.fqn).encode() + b":"
            parts.append(prefix)
            offset += len(prefix)
        data = planner.get_data(item)
        parts.append(data)
        results.append(WriteResult(item.index, StorageInfo(name, offset, len(data), zlib.crc32(data), encoding)))
        offset += len(data)
    if json_file:
        parts.append(b"}")
    blob = b"".join(parts)
    with open(path, "wb") as f:
        f.write(blob)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    return results, FileInfo(len(blob), zlib.crc32(blob))


def _split_by_bytes(items: List[WriteItem], parts: int) -> List[List[WriteItem]]:
    def nbytes(item: WriteItem) -> int:
        td = item.tensor_data
        return numel(td.chunk.sizes) * td.dtype.itemsize

    buckets: List[List[WriteItem]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for item in sorted(items, key=nbytes, reverse=True):
        i = loads.index(min(loads))
        buckets[i].append(item)
        loads[i] += nbytes(item)
    return [sorted(b, key=lambda it: it.index.fqn) for b in buckets if b]


# ------------------------------------------------------------------- write results <-> JSON

def _results_to_json(result: RankWriteResult) -> str:
    return json.dumps({
        "items": [[r.index.fqn, r.index.offset, r.index.index, r.storage.relative_path, r.storage.offset,
                   r.storage.length, r.storage.checksum, r.storage.encoding] for r in result.items],
        "files": {n: [f.size, f.checksum] for n, f in result.files.items()},
    })


def _results_from_json(text: str) -> RankWriteResult:
    doc = json.loads(text)
    items = [WriteResult(MetadataIndex(fqn, None if off is None else tuple(off), idx),
                         StorageInfo(path, start, length, crc, enc))
             for fqn, off, idx, path, start, length, crc, enc in doc["items"]]
    return RankWriteResult(items, {n: FileInfo(s, c) for n, (s, c) in doc["files"].items()})


def record_results(metadata: Metadata, results: List[RankWriteResult]) -> None:
    """Add every rank's written items and files to ``metadata``."""
    for result in results:
        for r in result.items:
            metadata.storage_data[r.index] = r.storage
        metadata.files.update(result.files)


# ------------------------------------------------------------------------------- the writer

class FileSystemWriter(StorageWriter):
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
        self.path = None if path is None else os.fspath(path)
        self.thread_count, self.sync_files = thread_count, sync_files
        self.allow_pickle, self.commit_timeout_s = allow_pickle, commit_timeout_s
        self.is_coordinator, self.rank, self.world_size, self.use_collectives = True, 0, 1, True

    def initialize_writer(self, checkpoint_id: Optional[str]) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        if not self.path:
            raise ValueError("no checkpoint path: pass checkpoint_id or FileSystemWriter(path)")
        self.path = os.path.abspath(self.path)

    def configure_writer(self, is_coordinator: bool, *, rank: int = 0, world_size: int = 1,
                         use_collectives: bool = True, **kwargs: Any) -> None:
        self.is_coordinator, self.rank, self.world_size = is_coordinator, rank, world_size
        self.use_collectives = use_collectives
        committed = (METADATA_FILE, _RANK_METADATA.format(rank))
        if not use_collectives and any(os.path.exists(os.path.join(self.path, n)) for n in committed):
            raise CheckpointError(
                f"{self.path} already holds a checkpoint; a save with use_collectives=False cannot "
                "replace it atomically: choose a new checkpoint_id"
            )

    def optimize_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        """Coordinator: pick this save's id and create its staging directory."""
        save_id = uuid.uuid4().hex
        staging = self._staging_for(save_id)
        os.makedirs(staging)
        storage = {"save_id": save_id, "staging": staging}
        for plan in plans:
            plan.storage_data = storage
        return plans

    def _target_dir(self, plan: SavePlan) -> str:
        return plan.storage_data["staging"] if self.use_collectives else self.path

    def execute_write(self, plan: SavePlan, planner: SavePlanner) -> RankWriteResult:
        directory = self._target_dir(plan)
        os.makedirs(directory, exist_ok=True)
        tensors = [it for it in plan.items if it.type == WriteItemType.TENSOR]
        values: Dict[str, List[WriteItem]] = {}
        for it in plan.items:
            if it.type == WriteItemType.BYTE_IO:
                values.setdefault(it.bytes_io_data.encoding, []).append(it)
        if "pickle" in values and not self.allow_pickle:
            raise ValueError(f"{values['pickle'][0].index.fqn!r} needs pickling; pass allow_pickle=True")
        jobs = []
        for i, bucket in enumerate(_split_by_bytes(tensors, self.thread_count)):
            name = f"__{self.rank}_{i}.safetensors"
            jobs.append((_write_safetensors, name, bucket, ()))
        for encoding, items in values.items():
            name = f"__{self.rank}.values.{'json' if encoding == 'json' else 'pkl'}"
            jobs.append((_write_values, name, items, (encoding,)))
        result = RankWriteResult([], {})

        def run(job):
            fn, name, items, extra = job
            # no-collective saves land in the live directory: write aside, then rename.
            final = os.path.join(directory, name)
            path = final if self.use_collectives else final + ".tmp"
            out = fn(path, items, planner, name, *extra, self.sync_files)
            if path != final:
                os.replace(path, final)
            return out

        if len(jobs) > 1 and self.thread_count > 1:
            with ThreadPoolExecutor(min(self.thread_count, len(jobs))) as pool:
                outputs = list(pool.map(run, jobs))
        else:
            outputs = [run(job) for job in jobs]
        for (_, name, _, _), (items, info) in zip(jobs, outputs):
            result.items.extend(items)
            result.files[name] = info
        if self.sync_files and not self.use_collectives:
            _fsync_dir(directory)  # collective saves: the coordinator fsyncs the staging dir once
        return result

    def finalize_checkpoint(self, metadata: Metadata, results: List[RankWriteResult]) -> None:
        record_results(metadata, results)
        if not self.use_collectives:
            metadata.rank = self.rank
            _write_file_atomically(os.path.join(self.path, _RANK_METADATA.format(self.rank)),
                                   metadata.to_json().encode(), self.sync_files)
            return
        staging = self._staging_for(metadata.save_id)
        _write_file_atomically(os.path.join(staging, METADATA_FILE), metadata.to_json().encode(), self.sync_files)
        if self.sync_files:
            _fsync_dir(staging)
        _replace_dir(staging, self.path)

    def abort_checkpoint(self, plan: SavePlan) -> None:
        """Coordinator, after a failed collective save (every rank has stopped writing):
        remove the staging directory."""
        if self.use_collectives and isinstance(plan.storage_data, dict):
            shutil.rmtree(plan.storage_data["staging"], ignore_errors=True)

    def _staging_for(self, save_id: str) -> str:
        return os.path.join(os.path.dirname(self.path), f".{os.path.basename(self.path)}.staging-{save_id}")

    # --- commit without collectives, for async saves (see docs/checkpoint.md) -------------

    def publish_result(self, plan: SavePlan, result: RankWriteResult) -> None:
        """Write this rank's "done" marker (its write results) into the staging directory."""
        # Not fsynced: the coordinator deletes markers before committing, and a crash before
        # the commit leaves an uncommitted staging directory either way.
        _write_file_atomically(os.path.join(self._target_dir(plan), _DONE_MARKER.format(self.rank)),
                               _results_to_json(result).encode(), sync=False)

    def publish_failure(self, plan: SavePlan, error: BaseException) -> None:
        """Tell the other ranks (best effort) that this rank's part of the save failed."""
        try:
            _write_file_atomically(os.path.join(self._target_dir(plan), _FAILED_MARKER.format(self.rank)),
                                   repr(error).encode(), sync=False)
        except OSError:
            pass

    def _poll(self, staging: str, done: Callable[[List[str]], bool], waiting_for: Callable[[], str]) -> None:
        """List ``staging`` until ``done(names)`` (or it is gone: names == []), raising on a
        failure marker or after ``commit_timeout_s``. Backs off to keep a shared file
        system's metadata load low when thousands of ranks wait."""
        deadline = time.monotonic() + self.commit_timeout_s
        delay = 0.005
        while True:
            try:
                names = os.listdir(staging)
            except FileNotFoundError:
                names = []
            failed = sorted(n for n in names if n.startswith(".failed.rank"))
            if failed:
                with open(os.path.join(staging, failed[0])) as f:
                    reason = f.read()
                raise CheckpointError(f"async save to {self.path} failed on {failed[0][8:]}: {reason}")
            if done(names):
                return
            if time.monotonic() > deadline:
                raise CheckpointError(f"async save to {self.path}: {waiting_for()} within "
                                      f"{self.commit_timeout_s:.0f}s; the checkpoint was not committed")
            time.sleep(delay)
            delay = min(delay * 2, 0.5)

    def collect_results(self, plan: SavePlan) -> List[RankWriteResult]:
        """Coordinator: wait for every rank's done marker (bounded by ``commit_timeout_s``)."""
        staging = self._target_dir(plan)
        markers = [_DONE_MARKER.format(r) for r in range(self.world_size)]
        missing = set(markers)

        def all_done(names: List[str]) -> bool:
            missing.difference_update(names)
            return not missing

        self._poll(staging, all_done, lambda: f"ranks did not finish writing (missing {sorted(missing)[:8]})")
        results = []
        for marker in markers:
            with open(os.path.join(staging, marker)) as f:
                results.append(_results_from_json(f.read()))
            os.remove(os.path.join(staging, marker))
        return results

    def wait_committed(self, plan: SavePlan) -> None:
        """Non-coordinators: wait until the coordinator has renamed the staging directory away."""
        staging = self._target_dir(plan)
        self._poll(staging, lambda names: not os.path.exists(staging), lambda: "the coordinator did not commit")


# ------------------------------------------------------------------------------- the reader

def _metadata_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None


def _merge_rank_metadata(parts: List[Metadata], directory: str) -> Metadata:
    world = parts[0].world_size
    ranks = sorted(p.rank for p in parts)
    if ranks != list(range(world)) or any(p.world_size != world for p in parts):
        raise CheckpointError(
            f"{directory} holds rank-local metadata of ranks {ranks}, expected ranks 0..{world - 1}: "
            "the checkpoint is incomplete"
        )
    merged = Metadata(state_dict_metadata={}, world_size=world, save_id=parts[0].save_id)
    chunks_seen: Dict[str, set] = {}
    for part in sorted(parts, key=lambda p: p.rank):
        for index, info in part.storage_data.items():
            kept = merged.storage_data.setdefault(index, info)
            if kept is not info and kept.checksum != info.checksum:
                # Plain values are written by every rank without collectives; copies must agree.
                raise CheckpointError(f"{directory}: ranks saved different values for {index.fqn!r} "
                                      f"(files {kept.relative_path} and {info.relative_path})")
        for fqn, md in part.state_dict_metadata.items():
            existing = merged.state_dict_metadata.setdefault(fqn, md)
            if isinstance(md, TensorStorageMetadata):
                known = chunks_seen.setdefault(fqn, set(existing.chunks))
                if existing is not md:
                    existing.chunks.extend(c for c in md.chunks if c not in known)
                    known.update(md.chunks)
        merged.files.update(part.files)
        merged.layouts.update(part.layouts)
    return merged


def read_checkpoint_metadata(directory: str) -> Metadata:
    """The committed metadata of a checkpoint directory (no process group needed).

    Raises:
        CheckpointError: nothing committed there, or the metadata is corrupt.
    """
    directory = os.fspath(directory)
    main = os.path.join(directory, METADATA_FILE)
    if os.path.exists(main):
        return Metadata.from_json(_metadata_text(main), main)
    rank_files = glob.glob(os.path.join(glob.escape(directory), _RANK_METADATA.format("*")))
    if not rank_files:
        raise CheckpointError(f"{directory} is not a committed checkpoint: {METADATA_FILE} is missing")
    parts = [Metadata.from_json(_metadata_text(p), p) for p in rank_files]
    return _merge_rank_metadata(parts, directory)


def is_checkpoint(path: str) -> bool:
    """True only for a directory whose metadata was committed (all ranks' for rank-local saves)."""
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, METADATA_FILE)):
        return True
    try:
        read_checkpoint_metadata(path)
    except CheckpointError:
        return False
    return True


class FileSystemReader(StorageReader):
    """Reads a checkpoint directory, fetching only the byte ranges each rank needs.

    Args:
        checkpoint_dir: the checkpoint directory (or pass ``checkpoint_id`` to ``load``).
        verify: check every chunk read (read whole) against its crc32 in the metadata.
        allow_pickle: accept pickled values (only for checkpoints you trust).
        thread_count: tensor reads in flight at once on this rank.
    """

    def __init__(self, checkpoint_dir: Optional[str] = None, *, verify: bool = False,
                 allow_pickle: bool = False, thread_count: int = 1) -> None:
        if thread_count < 1:
            raise ValueError(f"thread_count must be >= 1, got {thread_count}")
        self.path = None if checkpoint_dir is None else os.fspath(checkpoint_dir)
        self.verify, self.allow_pickle, self.thread_count = verify, allow_pickle, thread_count
        self.metadata: Optional[Metadata] = None

    def initialize_reader(self, checkpoint_id: Optional[str]) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        if not self.path:
            raise ValueError("no checkpoint path: pass checkpoint_id or FileSystemReader(path)")

    def read_metadata(self) -> Metadata:
        """The checkpoint's metadata; works without a process group."""
        return read_checkpoint_metadata(self.path)

    def load_metadata(self, **kwargs: Any) -> Metadata:
        return self.read_metadata()

    def configure_reader(self, metadata: Metadata, is_coordinator: bool, **kwargs: Any) -> None:
        self.metadata = metadata
        self.verify = self.verify or bool(kwargs.get("verify", False))
        self._chunk_sizes = {
            (fqn, c.offsets): c.sizes
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata) for c in md.chunks
        }

    def _open(self, name: str) -> int:
        check_relative_path(name)
        path = os.path.join(self.path, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {path} is missing") from None
        expected = self.metadata.files.get(name)
        actual = os.fstat(fd).st_size
        if expected is not None and actual != expected.size:
            os.close(fd)
            raise CheckpointError(f"checkpoint file {path} has {actual} bytes, metadata says {expected.size} "
                                  "(truncated or replaced)")
        return fd

    def _storage(self, index: MetadataIndex) -> StorageInfo:
        info = self.metadata.storage_data.get(index)
        if info is None:
            raise CheckpointError(f"checkpoint metadata has no storage location for {index}")
        return info

    def _check(self, data, info: StorageInfo, what: str) -> None:
        if self.verify and zlib.crc32(data) != info.checksum:
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

            def read(pair: Tuple[StorageInfo, ReadItem]) -> None:
                self._read_tensor(fds[pair[0].relative_path], pair[0], pair[1], planner)

            if self.thread_count > 1 and len(tensors) > 1:
                with ThreadPoolExecutor(min(self.thread_count, len(tensors)),
                                        thread_name_prefix="hyper_parallel-read") as pool:
                    list(pool.map(read, tensors))
            else:
                for pair in tensors:
                    read(pair)
        finally:
            for fd in fds.values():
                os.close(fd)

    def _read_value(self, fd: int, info: StorageInfo, key: str) -> Any:
        data = bytearray(info.length)
        _read_exact(fd, data, info.offset, os.path.join(self.path, info.relative_path))
        self._check(data, info, key)
        try:
            return decode_value(bytes(data), info.encoding, key, allow_pickle=self.allow_pickle)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None

    def _read_tensor(self, fd: int, info: StorageInfo, item: ReadItem, planner: LoadPlanner) -> None:
        key = item.storage_index.fqn
        md = self.metadata.state_dict_metadata[key]
        sizes = self._chunk_sizes.get((key, item.storage_index.offset))
        if sizes is None or numel(sizes) * md.dtype.itemsize != info.length:
            raise CheckpointError(f"checkpoint metadata of {key!r} chunk {item.storage_index.offset} is inconsistent")
        box = _BoxGeometry(sizes, item.storage_offsets, item.lengths)
        itemsize = md.dtype.itemsize
        path = os.path.join(self.path, info.relative_path)
        dest = planner.acquire_tensor(item)
        if self.verify:
            # The checksum covers the whole chunk, so read it whole.
            chunk = torch.empty(numel(sizes), dtype=md.dtype)
            _read_exact(fd, _flat_bytes(chunk), info.offset, path)
            self._check(_flat_bytes(chunk), info, f"{key} chunk {item.storage_index.offset}")
            planner.apply_tensor(item, chunk.as_strided(item.lengths, box.strides, box.first))
        elif box.contiguous and dest.is_contiguous() and dest.device.type == "cpu" and dest.dtype == md.dtype:
            # One byte range into plain memory: read straight into the destination.
            _read_exact(fd, _flat_bytes(dest), info.offset + box.first * itemsize, path)
            planner.apply_tensor(item, dest)
        else:
            # A box with gaps (e.g. a column block of a row-major chunk): read each of its
            # contiguous runs, never the bytes between them, so ranks that split a chunk
            # read each stored byte once in total. A syscall per run costs ~3 us; reading
            # the gaps would cost their bytes on every rank that needs the chunk.
            buffer = dest if dest.is_contiguous() and dest.device.type == "cpu" and dest.dtype == md.dtype \
                else torch.empty(item.lengths, dtype=md.dtype)
            view, run_bytes, pread = memoryview(_flat_bytes(buffer)), box.run * itemsize, os.preadv
            for i, start in enumerate(box.run_starts()):
                part, at = view[i * run_bytes:(i + 1) * run_bytes], info.offset + start * itemsize
                if pread(fd, [part], at) != run_bytes:
                    _read_exact(fd, part, at, path)  # a short read: finish it, or name the truncation
            planner.apply_tensor(item, buffer)


class _BoxGeometry:
    """Where a box of a row-major chunk lies, in elements from the chunk's start."""

    def __init__(self, sizes: Tuple[int, ...], offsets: Tuple[int, ...], lengths: Tuple[int, ...]) -> None:
        self.offsets, self.lengths = offsets, lengths
        self.strides = [1] * len(sizes)
        for d in range(len(sizes) - 2, -1, -1):
            self.strides[d] = self.strides[d + 1] * sizes[d + 1]
        self.first = sum(o * s for o, s in zip(offsets, self.strides))
        self.span = sum((n - 1) * s for n, s in zip(lengths, self.strides)) + 1
        self.volume = numel(lengths)
        self.contiguous = self.span == self.volume
        # Runs: the box's contiguous pieces, spanning every dim from the last partial one on.
        partial = [d for d, (n, size) in enumerate(zip(lengths, sizes)) if n != size]
        self.run_dim = partial[-1] if partial else 0
        self.run = numel(lengths[self.run_dim:])

    def run_starts(self) -> List[int]:
        """Element offset of every run, in the box's row-major order."""
        starts = torch.tensor([self.first], dtype=torch.int64)
        for n, stride in zip(self.lengths[:self.run_dim], self.strides[:self.run_dim]):
            starts = (starts[:, None] + torch.arange(n, dtype=torch.int64) * stride).reshape(-1)
        return starts.tolist()


def verify_checkpoint(checkpoint_dir: str) -> Metadata:
    """Check every data file of a checkpoint against the sizes and crc32s in its metadata.

    Returns the metadata. Raises:
        CheckpointError: uncommitted, or a file is missing, has the wrong size or checksum.
    """
    metadata = read_checkpoint_metadata(checkpoint_dir)
    for name, info in sorted(metadata.files.items()):
        path = os.path.join(checkpoint_dir, name)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {path} is missing") from None
        if size != info.size:
            raise CheckpointError(f"checkpoint file {path} has {size} bytes, metadata says {info.size}")
        crc = 0
        with open(path, "rb") as f:
            while block := f.read(1 << 24):
                crc = zlib.crc32(block, crc)
        if crc != info.checksum:
            raise CheckpointError(f"checkpoint file {path} fails its checksum: the file is corrupt")
    return metadata
