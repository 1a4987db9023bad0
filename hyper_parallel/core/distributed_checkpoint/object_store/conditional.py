"""Conditional writes on an fsspec file system, for the folder lease (``lease.py``), and the
clean-up of incomplete multipart uploads.

:class:`ObjectOps` is the generic one: create-if-absent through fsspec's ``mode="create"``
(check-then-write unless the implementation makes it exclusive) and compare-then-write replaces.
:class:`LocalOps` (``file://``) creates exclusively (a hard link, which fails if the name
exists). :class:`S3Ops` makes both single conditional requests (``If-None-Match: *``,
``If-Match: <etag>``) and aborts multipart uploads. Each also says how to bound its requests
(:meth:`ObjectOps.bounded_options`, for start-up checks and the CLI) and names its endpoint.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable, Dict, NamedTuple, Optional, Sequence, Tuple, Type

from hyper_parallel.utils.fileio import write_file, write_file_atomically

Version = Any
"""What identifies one state of an object: its ETag on S3, its bytes elsewhere."""


class RequestBounds(NamedTuple):
    """How long one request to a store may take: ``timeout_s`` to connect and for each read
    of its answer, ``attempts`` tries in all (retries included)."""

    timeout_s: float
    attempts: int


def protocols(fs: Any) -> Tuple[str, ...]:
    """The protocols of an fsspec file system (an instance or its class)."""
    return tuple(fs.protocol) if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)


class ObjectOps:
    """Conditional operations on one fsspec file system (generic, see the module docstring)."""

    atomic = False
    """Whether create and replace are single conditional requests (no window for a race)."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    @staticmethod
    def bounded_options(bounds: RequestBounds) -> Dict[str, Any]:
        """fsspec options bounding each request by ``bounds``; none known for a generic store."""
        return {}

    def bound(self, bounds: RequestBounds) -> None:
        """Bound what options cannot, on a file system made with :meth:`bounded_options` (such
        options make it an instance of its own: fsspec caches instances by their options)."""

    def endpoint(self) -> str:
        """What the store's requests go to, for messages."""
        return f"the {protocols(self.fs)[0]}:// store"

    def create(self, path: str, data: bytes) -> Optional[Version]:
        """Write ``path`` if it does not exist; its version, or None when it existed."""
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return None
        return self._written_version(path, data)

    def _written_version(self, path: str, data: bytes) -> Version:
        return data

    def read(self, path: str) -> Optional[Tuple[bytes, Version]]:
        """(bytes, version) of ``path``, or None when it does not exist."""
        self.fs.invalidate_cache(path)
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        return data, data

    def replace(self, path: str, data: bytes, version: Version) -> Optional[Version]:
        """Overwrite ``path`` if it is still at ``version``; its new version, or None."""
        current = self.read(path)
        if current is None or current[1] != version:
            return None
        self.fs.pipe_file(path, data)
        return self._written_version(path, data)

    def delete(self, path: str, version: Version) -> bool:
        """Delete ``path`` if it is still at ``version`` (compare, then delete)."""
        current = self.read(path)
        if current is None or current[1] != version:
            return False
        self.fs.rm(path)
        return True

    def abort_uploads(self, prefix: str, doomed: Callable[[str], bool]) -> int:
        """Abort the incomplete multipart uploads under ``prefix`` whose key ``doomed``
        accepts; how many. Stores without such uploads have none to abort."""
        return 0


class LocalOps(ObjectOps):
    """:class:`ObjectOps` on the local file system: exclusive create, whole content at once."""

    def create(self, path: str, data: bytes) -> Optional[Version]:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        aside = f"{path}.{uuid.uuid4().hex}.tmp"
        write_file(aside, data, sync=True)
        try:
            os.link(aside, path)  # fails if ``path`` exists: no window between check and write
        except FileExistsError:
            return None
        finally:
            os.unlink(aside)
        return data

    def replace(self, path: str, data: bytes, version: Version) -> Optional[Version]:
        current = self.read(path)
        if current is None or current[1] != version:
            return None
        write_file_atomically(path, data)  # renamed over: readers never see half of it
        return data


class S3Ops(ObjectOps):
    """:class:`ObjectOps` on ``s3fs``: conditional requests, multipart upload clean-up."""

    atomic = True

    @staticmethod
    def bounded_options(bounds: RequestBounds) -> Dict[str, Any]:
        # botocore's timeouts and tries ("standard" retries)
        return {"config_kwargs": {"connect_timeout": bounds.timeout_s, "read_timeout": bounds.timeout_s,
                                  "retries": {"total_max_attempts": bounds.attempts, "mode": "standard"}}}

    def bound(self, bounds: RequestBounds) -> None:
        self.fs.retries = 1  # one pass of s3fs's own retry loop (a class attribute, no option)
        # botocore asks for "Expect: 100-continue" on every PUT/POST with a file-like body, and
        # aiohttp waits for that answer with no timeout: an endpoint that never answers would hang
        # each upload. Without it the body is sent at once and the read timeout bounds the answer.
        from botocore.handlers import add_expect_header

        self.fs.s3.meta.events.unregister("before-call.s3", add_expect_header)

    def endpoint(self) -> str:
        """The endpoint botocore resolved (``endpoint_url`` option, ``AWS_ENDPOINT_URL*``, config
        files, else AWS's own); creating the client sends no request."""
        return self.fs.s3.meta.endpoint_url

    def _written_version(self, path: str, data: bytes) -> Version:
        return self._etag(path)

    def _etag(self, path: str) -> Optional[str]:
        self.fs.invalidate_cache(path)
        try:
            return self.fs.info(path)["ETag"]
        except FileNotFoundError:
            return None

    def read(self, path: str) -> Optional[Tuple[bytes, Version]]:
        # The ETag first: bytes newer than it make a replace conditional on it fail, never succeed.
        etag = self._etag(path)
        if etag is None:
            return None
        try:
            return self.fs.cat_file(path), etag
        except FileNotFoundError:
            return None

    def replace(self, path: str, data: bytes, version: Version) -> Optional[Version]:
        bucket, key, _ = self.fs.split_path(path)
        try:
            out = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfMatch=version)
        except OSError:  # 412 (changed), 404 (deleted) or a failure: which, the object tells
            if self._etag(path) == version:
                raise  # the condition held: the request failed for another reason
            return None
        finally:
            self.fs.invalidate_cache(path)
        return out["ETag"]

    def abort_uploads(self, prefix: str, doomed: Callable[[str], bool]) -> int:
        bucket, key_prefix, _ = self.fs.split_path(prefix)
        key_prefix = key_prefix.rstrip("/") + "/"
        aborted = 0
        markers: dict = {}
        while True:
            page = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key_prefix, **markers)
            for upload in page.get("Uploads", []) or []:
                if upload["Key"].startswith(key_prefix) and doomed(upload["Key"][len(key_prefix):]):
                    self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"],
                                    UploadId=upload["UploadId"])
                    aborted += 1
            if not page.get("IsTruncated"):
                return aborted
            markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}


def ops_class(names: Sequence[str]) -> Type[ObjectOps]:
    """The operations for a file system of protocols ``names``: :class:`S3Ops` for s3fs,
    :class:`LocalOps` for ``file://``, else :class:`ObjectOps`."""
    if "s3" in names or "s3a" in names:
        return S3Ops
    return LocalOps if "file" in names else ObjectOps


def object_ops(fs: Any) -> ObjectOps:
    """The conditional operations of ``fs`` (see :func:`ops_class`)."""
    return ops_class(protocols(fs))(fs)
