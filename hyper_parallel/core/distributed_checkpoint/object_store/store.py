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
with fsspec ``storage_options`` on top. Every store :func:`open_store` opens bounds each request
instead of retrying for minutes: by ``LIBRARY_BOUNDS`` (save, load and the rest of the
library), or by tighter bounds within :func:`bounded_requests` (start-up checks, the CLI). An
endpoint that accepts connections but never answers is named in one line
(:func:`unreachable_message`; ``save``/``load`` raise it as a ``CheckpointError``:
:func:`unreachable_named`).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Type

from hyper_parallel._optional import require
from hyper_parallel.core.distributed_checkpoint._fileio import url_scheme
from hyper_parallel.core.distributed_checkpoint.object_store.conditional import (
    RequestBounds,
    object_ops,
    ops_class,
    protocols,
)
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.format.metadata import (
    MAX_METADATA_BYTES,
    METADATA_FILE,
    Metadata,
    check_relative_path,
)
from hyper_parallel.core.distributed_checkpoint.format.validation import check_metadata, verify_files
from hyper_parallel.utils.fileio import fsync_dir, redact_url, write_file_atomically

VERIFY_BLOCK_BYTES = 16 << 20
"""Bytes per request while verifying (each object is read once, front to back)."""
_TAGGED = re.compile(r"(?:__\d+(?:_\d+)?|\.done\.rank\d+|\.failed\.rank\d+)\.(?P<save_id>[0-9a-f]{32})(?:\..*)?")
DONE_MARKER = ".done.rank{}.{}.json"
FAILED_MARKER = ".failed.rank{}.{}"
STARTUP_BOUNDS = RequestBounds(timeout_s=10.0, attempts=2)
"""Each request of the recipe's start-up check and of the CLI: 10 s to connect and per read, 2 tries."""
LIBRARY_BOUNDS = RequestBounds(timeout_s=30.0, attempts=3)
"""Each request of the library's own stores outside :func:`bounded_requests`: 30 s to connect
and per read (a read of a large object only needs data to keep arriving), 3 tries."""
_BOUNDS: contextvars.ContextVar[Optional[RequestBounds]] = contextvars.ContextVar("request_bounds", default=None)


@contextlib.contextmanager
def bounded_requests(bounds: RequestBounds) -> Iterator[None]:
    """Within this block, the stores :func:`open_store` opens bound each request by ``bounds``
    (options the caller passes win). Outside it, by ``LIBRARY_BOUNDS``."""
    token = _BOUNDS.set(bounds)
    try:
        yield
    finally:
        _BOUNDS.reset(token)


def _with_bounds(options: Dict[str, Any], bounded: Dict[str, Any]) -> Dict[str, Any]:
    merged = dict(bounded, **options)
    for key, value in bounded.items():  # one level of nesting (s3fs's config_kwargs)
        if isinstance(value, dict) and isinstance(options.get(key), dict):
            merged[key] = dict(value, **options[key])
    return merged


def open_store(url: str, storage_options: Optional[Dict[str, Any]] = None) -> Tuple[Any, str]:
    """(fsspec file system, path on it without the scheme) for the checkpoint ``url``.

    Raises:
        ValueError: ``url`` is refused by ``url_scheme`` (credentials, a query, a chained
            URL), has no scheme fsspec knows, or its implementation is not installed.
    """
    scheme = url_scheme(url)  # refuses what must not reach fsspec; ``url`` is fit to show after it
    fsspec = require("fsspec", f"checkpoint {url!r}")
    options = dict(storage_options or {})
    try:
        bounds = _bounds()
        cls = fsspec.get_filesystem_class(scheme)
        options = _with_bounds(options, ops_class(protocols(cls)).bounded_options(bounds))
        fs, path = fsspec.core.url_to_fs(url, **options)
        object_ops(fs).bound(bounds)
    except ImportError as exc:
        raise ValueError(f"checkpoint {url!r}: the {scheme}:// file system is not installed ({exc}); "
                         "for s3:// pip install 'hyper_parallel[s3]'") from None
    except ValueError as exc:
        raise ValueError(f"checkpoint {url!r}: {scheme}:// is no storage fsspec knows ({exc}); use a local "
                         "path or an fsspec URL such as s3://bucket/prefix") from None
    return fs, path.rstrip("/")


def _bounds() -> RequestBounds:
    return _BOUNDS.get() or LIBRARY_BOUNDS


@contextlib.contextmanager
def unreachable_named(url: Optional[str]) -> Iterator[None]:
    """Within this block, a store that does not answer (:func:`unreachable_errors`) on the
    fsspec URL ``url`` raises ``CheckpointError`` with :func:`unreachable_message`; errors on a
    local path (``url`` without a scheme, or None) pass as they are."""
    try:
        yield
    except unreachable_errors() as exc:
        if url is None or not url_scheme(url):
            raise
        raise CheckpointError(unreachable_message(url, exc)) from None


def call_deadline(fs: Any) -> Dict[str, float]:
    """Keyword arguments ending one call of ``fs`` after all tries of its request had their
    time, within :func:`bounded_requests`: ``timeout=`` (fsspec cancels the call and raises
    ``FSTimeoutError``) on an async file system, nothing elsewhere or outside the block. For
    what the per-try timeouts miss (aiohttp waits for an answer to ``Expect: 100-continue``,
    which botocore sends with every PUT, without a timeout)."""
    bounds = _BOUNDS.get()
    if bounds is None or not fs.async_impl:
        return {}
    return {"timeout": bounds.attempts * bounds.timeout_s + 1.0}


def unreachable_errors() -> Tuple[Type[BaseException], ...]:
    """The exceptions that mean a store did not answer (refused, reset, timed out): the
    built-in ones, fsspec's timeout and, with s3fs, botocore's connection and HTTP errors."""
    found: List[Type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        from fsspec.exceptions import FSTimeoutError
        found.append(FSTimeoutError)
        from botocore.exceptions import ConnectionError as BotoConnectionError, HTTPClientError
        found += [BotoConnectionError, HTTPClientError]
    except ImportError:  # no fsspec or no botocore: none of their errors can occur either
        pass
    return tuple(found)


def client_errors() -> Tuple[Type[BaseException], ...]:
    """The exceptions an object store's client raises before or instead of a request, other
    than :func:`unreachable_errors` (with s3fs, botocore's own: missing or partial
    credentials, an unknown profile, a bad region); none without botocore."""
    try:
        from botocore.exceptions import BotoCoreError
    except ImportError:
        return ()
    return (BotoCoreError,)


def client_message(url: str, error: BaseException) -> str:
    """One line for ``error`` (one of :func:`client_errors`) met on ``url``."""
    return (f"{redact_url(url)}: the object store's client failed before any answer: {type(error).__name__}: "
            f"{redact_url(str(error))}; check the credentials (for S3: AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or storage_options) and the region")


def unreachable_message(url: str, error: BaseException) -> str:
    """One line for ``error`` (one of :func:`unreachable_errors`) met on ``url``: the store's
    endpoint, the bound in force and what to check (credentials and queries never shown)."""
    try:
        endpoint = object_ops(open_store(url)[0]).endpoint()
    except Exception:  # noqa: BLE001 (naming the endpoint must not hide the error itself)
        endpoint = f"the {url_scheme(url)}:// store"
    bounds = _bounds()
    within = f" ({bounds.attempts} tries of {bounds.timeout_s:g}s)"
    return (f"{redact_url(url)}: no answer from the object store at {redact_url(endpoint)}{within}: "
            f"{type(error).__name__}; check the endpoint (for S3: AWS_ENDPOINT_URL or storage_options), "
            "the network and that the store is running")


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
    return "file" in protocols(fs)


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
    """True when ``path`` holds a committed checkpoint: its metadata object exists.

    Raises:
        what the store raises but "not found" (``fs.isfile`` would answer False to a store
        that cannot be reached, or that refuses the request).
    """
    fs.invalidate_cache(path)
    try:
        return fs.info(f"{path}/{METADATA_FILE}")["type"] == "file"
    except FileNotFoundError:
        return False


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
