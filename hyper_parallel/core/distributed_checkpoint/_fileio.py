"""Durable file operations: atomic small-file writes, directory swap, fsync, exact reads.

Everything here is plain OS work with no checkpoint semantics; the commit protocol
(``commit.py``) and the writer/reader (``filesystem.py``) build on it.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import uuid

import torch

from hyper_parallel.core.distributed_checkpoint.metadata import CheckpointError


def fsync_dir(path: str) -> None:
    """Make a directory's entries (new, renamed or removed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(path: str, data: bytes, sync: bool = True) -> None:
    """Write ``data`` to ``path`` through a temporary name, so readers never see half a file."""
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


def flat_bytes(tensor: torch.Tensor):
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


def replace_dir(staging: str, final: str) -> None:
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
    fsync_dir(os.path.dirname(os.path.abspath(final)))


def read_exact(fd: int, buffer, offset: int, path: str) -> None:
    """Fill ``buffer`` from ``fd`` at ``offset``, naming the truncation if the file ends early."""
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
