"""Durable, safe file operations: open only regular files, write new files and small files
atomically, fsync files and directories, start writeback early.

Plain OS work with no checkpoint semantics (the checkpoint package presents the refusals here
as ``CheckpointError``: ``distributed_checkpoint/_fileio.py``); the trainer and scripts write
their small files through it too.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import stat
import tempfile
import uuid
from typing import Optional


def fsync_dir(path: str) -> None:
    """Make a directory's entries (new, renamed or removed files) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"))


class RefusedFileError(RuntimeError):
    """A file was refused: not a regular file, reached through a symbolic link or hard link
    for writing, or larger than the caller allows. The message names the path."""


def _not_regular(path: str, mode: int) -> RefusedFileError:
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return RefusedFileError(f"{path} is {kind}, not a regular file; refusing to use it")


def open_regular(path: str, flags: int = os.O_RDONLY, mode: int = 0o666) -> int:
    """``os.open(path, flags, mode)`` that only ever returns a regular file.

    The open cannot block (``O_NONBLOCK``, cleared afterwards: a FIFO or device would block or
    never end), anything but a regular file is refused after ``fstat``, and a file opened for
    writing is never reached through a symbolic link (``O_NOFOLLOW``) nor has other names
    (hard links): writing must not change another file.

    Raises:
        RefusedFileError: ``path`` is a directory, FIFO, device, socket, symbolic link (writing)
            or a file with several links (writing); names the path.
        OSError: as ``os.open`` (missing file, permissions).
    """
    writing = bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
    extra = os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if writing else 0)
    try:
        fd = os.open(path, flags | extra, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EOPNOTSUPP):
            try:
                found = os.lstat(path).st_mode
            except OSError:
                raise exc from None
            if not stat.S_ISREG(found):
                raise _not_regular(path, found) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _not_regular(path, info.st_mode)
        if writing and info.st_nlink > 1:
            raise RefusedFileError(f"{path} has {info.st_nlink} names (hard links); refusing to write to it, "
                                  "as that would change another file: remove it")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular_file(path: str, limit: int, what: str) -> bytes:
    """The bytes of regular file ``path`` (see :func:`open_regular`), at most ``limit`` of them.

    Raises:
        RefusedFileError: not a regular file, or larger than ``limit`` (names ``what``).
        OSError: as ``os.open``.
    """
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(fd).st_size
        if size > limit:
            raise RefusedFileError(f"{path} has {size} bytes, more than the {limit} bytes {what} may have; "
                                  "refusing to read it")
        return f.read(size)  # (what it has now: one that grows meanwhile is cut, and fails to parse)


def create_file(path: str):
    """A new file at ``path`` opened for binary writing: whatever is at ``path`` (a leftover of
    a failed save, a symbolic link) is removed first, never written through (``O_EXCL``)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return os.fdopen(open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb")


def write_file(path: str, data: bytes, sync: bool) -> None:
    """Write ``data`` as a new file at ``path`` (:func:`create_file`), fsynced if ``sync``."""
    with create_file(path) as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())


def write_file_atomically(path: str, data: bytes, sync: bool = True) -> None:
    """Write ``data`` to ``path`` through a temporary name, so readers never see half a file."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    write_file(tmp, data, sync)
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


_URL = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://")
_SCHEME_PREFIX = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
_DRIVE = re.compile(r"[A-Za-z]:[\\/]")  # a Windows drive (C:\\ or C:/): a path


_AT_SIGN = re.compile(r"@|%40", re.IGNORECASE)  # also percent-encoded: fsspec and botocore decode it
_COLON = re.compile(r":|%3a", re.IGNORECASE)


def _credentials_end(rest: str) -> int:
    """Where ``user:secret@`` ends in a URL after its ``scheme://`` (0: none), the ``:`` and
    ``@`` also percent-encoded (``%3A``, ``%40``). Up to the last ``@``, since a secret may hold
    ``/`` (AWS secret keys do); a ``@`` without a ``:`` before it is no credential
    (``abfs://container@account...``, ``sftp://user@host``)."""
    last = None
    for last in _AT_SIGN.finditer(rest):
        pass
    at = last.start() if last is not None else 0
    return at if at > 0 and _COLON.search(rest, 0, at) else 0


def redact_url(url: str) -> str:
    """``url`` as it may be shown in a message: credentials after the scheme
    (``s3://KEY:SECRET@bucket``) and a query or fragment (tokens) are
    replaced by ``***``; each part of a chained URL (``a::b``) alike. Paths are returned as
    they are."""
    if not _SCHEME_PREFIX.match(url):
        return url
    return "::".join(_redact_one(part) for part in url.split("::"))


def _redact_one(url: str) -> str:
    match = _URL.match(url)
    if not match:
        return url
    rest = url[match.end():]
    end = _credentials_end(rest)
    if end:
        rest = "***" + rest[end:]
    for mark in "?#":
        if mark in rest:
            rest = rest[:rest.index(mark)] + mark + "***"
    return url[:match.end()] + rest


def url_scheme(path) -> Optional[str]:
    """The scheme of a ``<scheme>://`` URL (``s3``, ``memory``, ``file``), or None for a path.

    The one place checkpoint locations are classified (save, load, ``CheckpointManager``, the
    CLI and the recipe all ask here), so the forms that would go wrong later are refused here,
    in one line that shows the URL through :func:`redact_url`.

    Raises:
        ValueError: a URL with credentials (``user:secret@``), a query (``?``) or a fragment (``#``): the
            store does not read credentials from the URL, and fsspec would take a query as
            part of the key (every object of a save under one key); a chained URL
            (``simplecache::s3://...``), a ``<scheme>:`` without ``//`` (``data:...``) or a URL
            with leading or trailing whitespace (`` s3://...``): these would otherwise become
            local folders of that name.
    """
    if not isinstance(path, str):
        return None
    if path != path.strip() and _SCHEME_PREFIX.match(path.strip()):
        raise ValueError(f"location {redact_url(path.strip())!r} has leading or trailing whitespace; refused (it "
                         "would become a local folder of that name): remove the whitespace")
    match = _URL.match(path)
    if match is None:
        if _SCHEME_PREFIX.match(path) and not _DRIVE.match(path):
            shown = redact_url(path)
            if "::" in path:
                raise ValueError(f"location {shown!r} chains file systems ('::'); refused: give the "
                                 "store's own URL (s3://bucket/prefix) or a path")
            raise ValueError(f"location {shown!r} starts with a scheme but is no <scheme>:// URL; "
                             "refused (it would become a local folder of that name): give an fsspec URL "
                             f"such as s3://bucket/prefix, or write a path as ./{shown}")
        return None
    shown = redact_url(path)
    rest = path[match.end():]
    if "::" in rest:
        raise ValueError(f"URL {shown!r} chains file systems ('::'); refused: give the store's own "
                         "URL (s3://bucket/prefix)")
    if _credentials_end(rest):
        raise ValueError(f"URL {shown!r} holds credentials ('user:secret@'); refused: the store "
                         "does not read them from the URL and they would show in logs; configure them the "
                         "store's way (for S3: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ~/.aws) or "
                         "through storage_options")
    if "?" in rest or "#" in rest:
        raise ValueError(f"URL {shown!r} has a query or fragment ('?', '#'); refused: a checkpoint is "
                         "a prefix of objects (fsspec would put every object of a save under one key, or "
                         "read one version of one object); remove it")
    return match.group("scheme")


def unusable_folder(path: str) -> Optional[str]:
    """Why folder ``path`` cannot be written (None: it can): it is created if missing, and a
    temporary file is made in it. A file in the way is named (``X is a file, not a folder``)."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as err:
        blocker = _first_file_on_path(path)
        return f"{blocker} is a file, not a folder" if blocker else (err.strerror or str(err))
    return None


def _first_file_on_path(path: str) -> Optional[str]:
    """The first existing non-folder among ``path`` and its parents, if any."""
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        prefix = os.sep.join(parts[:i])
        if os.path.exists(prefix) and not os.path.isdir(prefix):
            return prefix
    return None
