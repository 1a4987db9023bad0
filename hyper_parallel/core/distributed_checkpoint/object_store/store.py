"""A checkpoint's objects on an fsspec file system, and the commit protocol there.

Object stores have no rename, so a save cannot be staged aside and swapped in. Instead:

- every data object of a save carries the save's id in its name
  (``__{rank}_{i}.{save_id}.safetensors``, ``__{rank}.{save_id}.values.json``), so a save
  never overwrites an object a committed checkpoint uses;
- ``metadata.json`` is written last, in one PUT (objects appear whole or not at all): it
  is the commit point, and names the data objects of the save it commits. A prefix without
  it is no checkpoint: never listed, never loaded;
- after the commit, the coordinator deletes the objects of other save ids under the
  checkpoint's prefix (a replaced checkpoint's data, abandoned uploads of failed saves);
- async saves coordinate through marker objects of the save (``.done.rank{r}.{save_id}.json``,
  ``.failed.rank{r}.{save_id}``), polled with back-off; a dead rank is noticed only by the
  commit timeout (object stores have no cheap heartbeat).

Credentials and endpoints come from the file system's own configuration (for S3 what
botocore reads: ``AWS_*`` environment variables such as ``AWS_ENDPOINT_URL``, config files),
with fsspec ``storage_options`` on top.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from hyper_parallel._optional import require
from hyper_parallel.core.distributed_checkpoint._fileio import url_scheme
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.metadata import (
    MAX_METADATA_BYTES,
    METADATA_FILE,
    Metadata,
    check_relative_path,
)
from hyper_parallel.core.distributed_checkpoint.format.validation import check_metadata, verify_files
from hyper_parallel.utils.fileio import fsync_dir, write_file_atomically

VERIFY_BLOCK_BYTES = 16 << 20
"""Bytes per request while verifying (each object is read once, front to back)."""
_TAGGED = re.compile(r"(?:__\d+(?:_\d+)?|\.done\.rank\d+|\.failed\.rank\d+)\.(?P<save_id>[0-9a-f]{32})(?:\..*)?")
DONE_MARKER = ".done.rank{}.{}.json"
FAILED_MARKER = ".failed.rank{}.{}"


def open_store(url: str, storage_options: Optional[Dict[str, Any]] = None) -> Tuple[Any, str]:
    """(fsspec file system, path on it without the scheme) for the checkpoint ``url``.

    Raises:
        ValueError: ``url`` has no scheme fsspec knows, or its implementation is not installed.
    """
    fsspec = require("fsspec", f"checkpoint {url!r}")
    scheme = url_scheme(url)
    try:
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    except ImportError as exc:
        raise ValueError(f"checkpoint {url!r}: the {scheme}:// file system is not installed ({exc}); "
                         "for s3:// pip install 'hyper_parallel[s3]'") from None
    except ValueError as exc:
        raise ValueError(f"checkpoint {url!r}: {scheme}:// is no storage fsspec knows ({exc}); use a local "
                         "path or an fsspec URL such as s3://bucket/prefix") from None
    return fs, path.rstrip("/")


def open_checkpoint(checkpoint_id: Optional[str], url: Optional[str], storage_options: Optional[Dict[str, Any]],
                    owner: str) -> Tuple[str, Any, str]:
    """(URL, fsspec file system, path on it) of the checkpoint an ``owner`` (a writer or reader
    class) works on: ``checkpoint_id`` when given, else the ``url`` it was built with.

    Raises:
        ValueError: neither is given, or the URL's scheme is unknown (see :func:`open_store`).
    """
    url = checkpoint_id if checkpoint_id is not None else url
    if not url:
        raise ValueError(f"no checkpoint URL: pass checkpoint_id or {owner}(url)")
    return (url, *open_store(url, storage_options))


def is_local(fs: Any) -> bool:
    """Whether ``fs`` is the local file system (``file://``): directories, rename, partial writes."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "file" in protocols


def put_atomically(fs: Any, path: str, data: bytes) -> None:
    """Write the object ``path`` so that readers see all of ``data`` or nothing: one PUT on
    object stores; written aside and renamed on the local file system."""
    if not is_local(fs):
        fs.pipe_file(path, data)
        return
    write_file_atomically(path, data)  # a unique name aside, fsynced, renamed over
    fsync_dir(os.path.dirname(path))


def save_id_of(name: str) -> Optional[str]:
    """The save id in the name of a data or marker object, or None for other objects."""
    match = _TAGGED.fullmatch(name)
    return match.group("save_id") if match else None


def list_names(fs: Any, path: str) -> List[str]:
    """Names of the objects directly under ``path`` (fresh: the listing cache is dropped)."""
    fs.invalidate_cache(path)
    try:
        return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(path, detail=False)]
    except FileNotFoundError:
        return []


def is_committed(fs: Any, path: str) -> bool:
    """True when ``path`` holds a committed checkpoint: its metadata object exists."""
    fs.invalidate_cache(path)
    return fs.isfile(f"{path}/{METADATA_FILE}")


def read_metadata(fs: Any, path: str, url: str) -> Metadata:
    """The committed metadata under ``path``, checked like a local checkpoint's.

    Raises:
        CheckpointError: nothing committed there, or the metadata is too large or corrupt.
    """
    name = f"{path}/{METADATA_FILE}"
    fs.invalidate_cache(path)
    try:
        size = fs.size(name)
        if size > MAX_METADATA_BYTES:
            raise CheckpointError(f"{url}/{METADATA_FILE} has {size} bytes, more than {MAX_METADATA_BYTES}; refused")
        text = fs.cat_file(name)
    except FileNotFoundError:
        raise CheckpointError(f"{url} is not a committed checkpoint: {METADATA_FILE} is missing") from None
    metadata = Metadata.from_json(text, f"{url}/{METADATA_FILE}")
    check_metadata(metadata, url)
    return metadata


def check_object(fs: Any, path: str, url: str, name: str, metadata: Metadata) -> None:
    """The data object ``name`` is listed in ``metadata`` and exists with its recorded size.

    Raises:
        CheckpointError: not listed, missing, or of another size.
    """
    check_relative_path(name)
    expected = metadata.files.get(name)
    if expected is None:
        raise CheckpointError(f"checkpoint object {url}/{name} is not listed in the metadata")
    try:
        actual = fs.size(f"{path}/{name}")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint object {url}/{name} is missing") from None
    if actual != expected.size:
        raise CheckpointError(f"checkpoint object {url}/{name} has {actual} bytes, metadata says "
                              f"{expected.size} (truncated or replaced)")


def verify_objects(fs: Any, path: str, url: str, allow_pickle: bool = False) -> Metadata:
    """``verify_checkpoint`` for a checkpoint under ``url``: its metadata, then every data
    object read once, sequentially, against its checksums (``format/validation.verify_files``).

    Returns the metadata. Raises:
        CheckpointError: names what is uncommitted, inconsistent, missing, truncated or corrupt.
    """
    metadata = read_metadata(fs, path, url)

    @contextlib.contextmanager
    def open_object(name: str) -> Iterator[Callable[[int, int], bytes]]:
        check_object(fs, path, url, name, metadata)
        with fs.open(f"{path}/{name}", "rb", block_size=VERIFY_BLOCK_BYTES) as f:
            def read(offset: int, n: int) -> bytes:
                f.seek(offset)
                return f.read(n)

            yield read

    verify_files(url, metadata, allow_pickle, open_object)
    return metadata


def remove_saves(fs: Any, path: str, doomed: Callable[[str], bool]) -> None:
    """Delete the data and marker objects directly under ``path`` whose save id is
    ``doomed`` (one listing, one batched delete; other objects are left alone)."""
    stale = [f"{path}/{name}" for name in list_names(fs, path)
             if save_id_of(name) is not None and doomed(save_id_of(name))]
    if stale:
        fs.rm(stale)


def poll(fs: Any, path: str, url: str, save_id: str, timeout_s: float, done: Callable[[List[str]], bool],
         waiting_for: Callable[[], str]) -> None:
    """List ``path`` until ``done(names)``, raising on a failure marker of this save or after
    ``timeout_s``; backs off to 0.5 s between listings."""
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        names = list_names(fs, path)
        failed = sorted(n for n in names if n.startswith(".failed.rank") and save_id_of(n) == save_id)
        if failed:
            reason = fs.cat_file(f"{path}/{failed[0]}").decode(errors="replace")
            raise CheckpointError(f"async save to {url} failed on rank {failed[0].split('.')[2][4:]}: {reason}")
        if done(names):
            return
        if time.monotonic() > deadline:
            raise CheckpointError(f"async save to {url}: {waiting_for()} within {timeout_s:.0f}s; "
                                  "the checkpoint was not committed")
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
