"""The commit protocol: what makes a directory a checkpoint, and how ranks get there.

- A collective save writes into a pending directory next to the target (:func:`pending_dir`;
  on disk ``.{name}.staging-{save_id}``, a name kept so that leftovers of older runs are still
  recognised); the coordinator writes ``metadata.json`` into it last and swaps it into place
  (:func:`commit_pending_dir`).
- A save without collectives writes into the target and each rank commits its own
  ``metadata.rank{r}.json`` (:func:`commit_rank_metadata`); :func:`read_checkpoint_metadata`
  merges them once all ranks have.
- An async save coordinates its commit through marker files in the pending directory instead
  of collectives: each rank publishes ``.done.rank{r}.json`` (its write results) or
  ``.failed.rank{r}``; the coordinator collects them (:func:`collect_results`), the others wait
  for the pending directory to disappear (:func:`wait_committed`).
"""

from __future__ import annotations

import glob
import os
import re
import threading
import time
from typing import Callable, Dict, List, Optional

from hyper_parallel.core.distributed_checkpoint._fileio import (
    create_file,
    local_path,
    read_regular_file,
    replace_dir,
    write_file_atomically,
)
from hyper_parallel.core.distributed_checkpoint.encoding.results import DoneMarkers, results_from_json, results_to_json
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.metadata import (
    MAX_METADATA_BYTES,
    METADATA_FILE,
    Metadata,
    TensorStorageMetadata,
)
from hyper_parallel.core.distributed_checkpoint.format.validation import check_metadata, verify_files
from hyper_parallel.core.distributed_checkpoint.storage import RankWriteResult
from hyper_parallel.utils.fileio import fsync_dir

RANK_METADATA = "metadata.rank{}.json"
_DONE_MARKER = ".done.rank{}.json"
_FAILED_MARKER = ".failed.rank{}"
_ALIVE_MARKER = ".alive.rank{}"
HEARTBEAT_S = 0.5  # how often a writing rank touches its alive marker
DEAD_AFTER_S = 5.0  # a rank whose marker has not changed for this long is presumed dead
# ``.old``: a checkpoint swapped out by a commit where the OS has no atomic exchange.
_PENDING_DIR = re.compile(r"\.(?P<target>.+)\.staging-[0-9a-f]+(\.old)?")


# --------------------------------------------------------------------- pending directories

def pending_dir(path: str, save_id: str) -> str:
    """Where a collective save of checkpoint ``path`` with id ``save_id`` writes its files."""
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.staging-{save_id}")


def pending_target(name: str) -> Optional[str]:
    """The checkpoint name a pending directory ``name`` belongs to, or None if ``name`` is
    not a pending directory."""
    match = _PENDING_DIR.fullmatch(name)
    return match.group("target") if match else None


def has_committed_metadata(path: str, rank: int) -> bool:
    """True if ``path`` holds the global metadata or ``rank``'s rank-local metadata."""
    return any(os.path.exists(os.path.join(path, n)) for n in (METADATA_FILE, RANK_METADATA.format(rank)))


def commit_pending_dir(pending: str, path: str, metadata: Metadata, sync: bool) -> None:
    """Coordinator: write ``metadata.json`` into ``pending`` and swap it into place at ``path``."""
    for name in glob.glob(os.path.join(glob.escape(pending), _ALIVE_MARKER.format("*"))):
        os.remove(name)  # (their heartbeat threads stop when they find them gone)
    write_file_atomically(os.path.join(pending, METADATA_FILE), metadata.to_json().encode(), sync)
    if sync:
        fsync_dir(pending)
    replace_dir(pending, path)


def commit_rank_metadata(path: str, metadata: Metadata, sync: bool) -> None:
    """One rank of a save without collectives: commit its rank-local metadata."""
    write_file_atomically(os.path.join(path, RANK_METADATA.format(metadata.rank)), metadata.to_json().encode(), sync)


# ---------------------------------------------------------------- async commit by markers

def publish_result(pending: str, rank: int, result: RankWriteResult) -> None:
    """Write ``rank``'s "done" marker (its write results) into the pending directory."""
    # Not fsynced: the coordinator deletes markers before committing, and a crash before
    # the commit leaves an uncommitted pending directory either way.
    write_file_atomically(os.path.join(pending, _DONE_MARKER.format(rank)),
                          results_to_json(result).encode(), sync=False)


def publish_failure(pending: str, rank: int, error: BaseException) -> None:
    """Tell the other ranks (best effort) that ``rank``'s part of the save failed."""
    try:
        write_file_atomically(os.path.join(pending, _FAILED_MARKER.format(rank)), repr(error).encode(), sync=False)
    except OSError:
        pass


def start_heartbeat(pending: str, rank: int, timeout_s: float) -> None:
    """Touch ``rank``'s alive marker in ``pending`` every ``HEARTBEAT_S`` from a daemon thread,
    so that ranks waiting for this one notice within ``DEAD_AFTER_S`` if its process dies.
    The thread stops when the marker is gone (commit or abort) or after ``timeout_s``."""
    marker = os.path.join(pending, _ALIVE_MARKER.format(rank))
    create_file(marker).close()

    def beat() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(HEARTBEAT_S)
            try:
                os.utime(marker)
            except OSError:
                return

    threading.Thread(target=beat, name=f"hyper_parallel-heartbeat-{rank}", daemon=True).start()


class _Liveness:
    """Watches ranks' alive markers: a marker seen once whose mtime stops changing for
    ``DEAD_AFTER_S`` (measured on this host's clock, so clock skew between hosts does not
    matter) means its rank died. Ranks never seen are not judged (bounded by the timeout)."""

    def __init__(self, pending: str) -> None:
        self.pending = pending
        self.seen: Dict[int, tuple] = {}  # rank -> (mtime, local time it was first seen)

    def dead(self, ranks: List[int]) -> Optional[int]:
        now = time.monotonic()
        for rank in ranks:
            try:
                mtime = os.stat(os.path.join(self.pending, _ALIVE_MARKER.format(rank))).st_mtime_ns
            except FileNotFoundError:
                continue
            last = self.seen.get(rank)
            if last is None or last[0] != mtime:
                self.seen[rank] = (mtime, now)
            elif now - last[1] > DEAD_AFTER_S:
                return rank
        return None


def _poll(pending: str, path: str, timeout_s: float, done: Callable[[List[str]], bool],
          waiting_for: Callable[[], str], watched: Callable[[], List[int]]) -> None:
    """List ``pending`` until ``done(names)`` (or it is gone: names == []), raising on a
    failure marker, when a ``watched()`` rank stopped its heartbeat, or after ``timeout_s``.
    Backs off to keep a shared file system's metadata load low when thousands of ranks wait."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    liveness = _Liveness(pending)
    while True:
        try:
            names = os.listdir(pending)
        except FileNotFoundError:
            names = []
        failed = sorted(n for n in names if n.startswith(".failed.rank"))
        if failed:
            with open(os.path.join(pending, failed[0])) as f:
                reason = f.read()
            raise CheckpointError(f"async save to {path} failed on {failed[0][8:]}: {reason}")
        if done(names):
            return
        dead = liveness.dead(watched())
        if dead is not None:
            raise CheckpointError(f"async save to {path}: rank {dead} stopped responding (no heartbeat for "
                                  f"{DEAD_AFTER_S:.0f}s; its process presumably died); the checkpoint was not committed")
        if time.monotonic() > deadline:
            raise CheckpointError(f"async save to {path}: {waiting_for()} within "
                                  f"{timeout_s:.0f}s; the checkpoint was not committed")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)


def collect_results(pending: str, path: str, world_size: int, timeout_s: float) -> List[RankWriteResult]:
    """Coordinator: wait for every rank's done marker (bounded by ``timeout_s``) and read them."""
    markers = DoneMarkers({r: _DONE_MARKER.format(r) for r in range(world_size)})
    _poll(pending, path, timeout_s, markers.seen, markers.waiting_for, markers.missing_ranks)
    results = []
    for marker in markers.names:
        with open(os.path.join(pending, marker)) as f:
            results.append(results_from_json(f.read()))
        os.remove(os.path.join(pending, marker))
    return results


def wait_committed(pending: str, path: str, save_id: str, timeout_s: float) -> Metadata:
    """Non-coordinators: wait until the coordinator has renamed the pending directory away;
    returns the committed metadata.

    Raises:
        CheckpointError: a rank failed, the wait timed out, or another save replaced this one.
    """
    _poll(pending, path, timeout_s, lambda names: not os.path.exists(pending), lambda: "the coordinator did not commit",
          lambda: [0])
    try:
        metadata = read_checkpoint_metadata(path)
    except CheckpointError:
        raise CheckpointError(f"async save to {path} was not committed: another rank failed and removed "
                              "its pending directory") from None
    if metadata.save_id != save_id:
        raise CheckpointError(f"async save to {path} was replaced by another save before it committed")
    return metadata


# ---------------------------------------------------------------- reading committed metadata

def _metadata_text(path: str) -> bytes:
    try:
        return read_regular_file(path, MAX_METADATA_BYTES, "checkpoint metadata")
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None


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
            if kept.checksum != info.checksum:
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
    directory = local_path(directory)
    main = os.path.join(directory, METADATA_FILE)
    if os.path.lexists(main):
        metadata = Metadata.from_json(_metadata_text(main), main)
    else:
        rank_files = glob.glob(os.path.join(glob.escape(directory), RANK_METADATA.format("*")))
        if not rank_files:
            raise CheckpointError(f"{directory} is not a committed checkpoint: {METADATA_FILE} is missing")
        metadata = _merge_rank_metadata([Metadata.from_json(_metadata_text(p), p) for p in rank_files], directory)
    check_metadata(metadata, directory)
    return metadata


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


def verify_checkpoint(checkpoint_dir: str, *, allow_pickle: bool = False) -> Metadata:
    """Run every check ``load`` runs, without loading: the metadata's schema and consistency
    (chunks tile each tensor, byte ranges inside their files), every file's size, every
    item's and every file's checksum (every byte is read once), and every value decodes as
    ``load`` decodes it: JSON, or pickled only with ``allow_pickle`` (as ``load`` needs
    ``FileSystemReader(..., allow_pickle=True)``; verify never unpickles).

    Returns the metadata. Raises:
        CheckpointError: names what is uncommitted, inconsistent, missing, truncated or corrupt.
    """
    metadata = read_checkpoint_metadata(checkpoint_dir)
    verify_files(checkpoint_dir, metadata, allow_pickle)
    return metadata
