"""``FileSystemReader``: a load's reads from a committed checkpoint directory (see ``writer.py``
for its files), each rank fetching only the byte ranges it needs: whole chunks through
``block_reads.py`` (checked as read), parts of chunks through ``bounce.py``; which rank
checks a chunk several ranks share is ``planning/verify_plan.py``.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from hyper_parallel.core.distributed_checkpoint._fileio import flat_bytes, local_path, read_exact
from hyper_parallel.core.distributed_checkpoint.filesystem.block_reads import BlockReads
from hyper_parallel.core.distributed_checkpoint.host_memory.bounce import BounceReads, load_bounces, read_box
from hyper_parallel.core.distributed_checkpoint.filesystem.commit import read_checkpoint_metadata
from hyper_parallel.core.distributed_checkpoint.format.checksum import crc32
from hyper_parallel.core.distributed_checkpoint.format.geometry import BoxGeometry
from hyper_parallel.core.distributed_checkpoint.format.metadata import (
    Metadata,
    MetadataIndex,
    StorageInfo,
)
from hyper_parallel.core.distributed_checkpoint.format.validation import decode_stored_value, open_data_file
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from hyper_parallel.core.distributed_checkpoint.planning.verify_plan import VerifyingReader, duties_of, reads_whole
from hyper_parallel.platform import get_platform


_SPAN_GAP_BYTES = 8 << 10
"""A box whose pieces lie less than this many bytes apart (on average) is read as whole rows and
copied out in memory: a syscall per piece (~3 us) costs more than copying the gap (measured by
``benchmarks/piece_reads.py``). The disk and the page cache read whole pages and readahead
windows either way."""


class FileSystemReader(VerifyingReader):
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

    def stored_at(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _open(self, name: str) -> int:
        return open_data_file(self.path, name, self.metadata)

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
            # Every reader thread's copy stream is built here, on the caller's device (ordered
            # after the caller's stream), and the readers share one window of slabs (bounce.py:
            # they cannot wait on each other).
            threads = min(self.thread_count, len(tensors))
            bounces = load_bounces(planner, max(threads, 1))

            def read(group: List[Tuple[StorageInfo, ReadItem]], bounce: BounceReads) -> None:
                get_platform().use_device(bounce.device)
                blocks = BlockReads()
                try:
                    for info, item in group:
                        self._read_tensor(fds[info.relative_path], info, item, planner, bounce, blocks, duties)
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
        read_exact(fd, data, info.offset, self.stored_at(info.relative_path))
        if self._verifying:
            self._check(crc32(data), info, key)
        return decode_stored_value(bytes(data), info.encoding, key, allow_pickle=self.allow_pickle)

    def _read_tensor(self, fd: int, info: StorageInfo, item: ReadItem, planner: LoadPlanner,
                     bounce: BounceReads, blocks: BlockReads, duties: Optional[FrozenSet[MetadataIndex]]) -> None:
        key = item.storage_index.fqn
        md = self.metadata.state_dict_metadata[key]
        sizes = self._chunk_sizes(item, info)
        path = self.stored_at(info.relative_path)
        dest = planner.acquire_tensor(item)
        plain = dest.is_contiguous() and dest.device.type == "cpu" and dest.dtype == md.dtype
        whole = reads_whole(item, sizes)
        if self._verifying and (whole or duties is None or item.storage_index in duties):
            # The checksum covers the whole chunk, so read it whole: straight into the
            # destination when that is the whole chunk in plain memory, checked as it is read.
            # Destinations not filled in place (device memory, strided, another dtype) get
            # their boxes through the bounce slabs and the copy stream, as unchecked reads do.
            if whole and plain:
                crc = blocks.read_into(fd, flat_bytes(dest), info.offset, path)
            else:
                copy = None if plain else functools.partial(bounce.copy, key=key)
                crc = blocks.read_box(fd, info.offset, sizes, item, dest, md.dtype, path, copy)
            self._check(crc, info, f"{key} chunk {item.storage_index.offset}")
            if plain:
                planner.apply_tensor(item, dest)
            else:
                bounce.apply_after_copies(item, dest)
        elif plain:  # not checked here: verify=False, or another rank checks this chunk
            box = BoxGeometry(sizes, item.storage_offsets, item.lengths)
            if box.contiguous or (box.span - box.volume) * box.run * md.dtype.itemsize >= _SPAN_GAP_BYTES * box.volume:
                read_box(fd, dest, box, info.offset, md.dtype.itemsize, path)  # straight into plain memory
            else:  # many pieces with small gaps: a few large reads of their rows beat a syscall each
                blocks.read_rows(fd, info.offset, sizes, item, dest, md.dtype, path)
            planner.apply_tensor(item, dest)
        else:
            bounce.read(fd, path, info.offset, sizes, item, dest, md.dtype)
