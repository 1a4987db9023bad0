"""The checkpoint package's file operations: :mod:`hyper_parallel.utils.fileio`'s safe opens and
durable writes with their refusals presented as :class:`CheckpointError`, plus what only
checkpoints need: checkpoint paths (no URLs), exact reads of stored bytes, and the atomic swap
of a committed directory.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
from typing import Callable, TypeVar

import torch

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.utils import fileio
from hyper_parallel.utils.fileio import fsync_dir, url_scheme  # noqa: F401  (re-exported)

_Operation = TypeVar("_Operation", bound=Callable)


def _presented(operation: _Operation) -> _Operation:
    """``operation`` raising :class:`CheckpointError` where it refuses a file."""

    @functools.wraps(operation)
    def presented(*args, **kwargs):
        try:
            return operation(*args, **kwargs)
        except fileio.RefusedFileError as exc:
            raise CheckpointError(str(exc)) from None

    return presented  # type: ignore[return-value]


open_regular = _presented(fileio.open_regular)
read_regular_file = _presented(fileio.read_regular_file)
create_file = _presented(fileio.create_file)
write_file = _presented(fileio.write_file)
write_file_atomically = _presented(fileio.write_file_atomically)


def local_path(path) -> str:
    """``path`` (str or PathLike) as a string, refusing a URL (``s3://...``): the POSIX
    writer and reader take file system paths only (URLs go through ``object_store/``), and
    ``s3:`` would otherwise become a local folder.

    Raises:
        ValueError: ``path`` starts with ``<scheme>://``.
    """
    path = os.fspath(path)
    scheme = url_scheme(path)
    if scheme:
        raise ValueError(f"checkpoint path {path!r} is a {scheme}:// URL; this needs a file system path: use a "
                         "local or mounted directory (URLs are read and written by FsspecWriter/FsspecReader)")
    return path


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
