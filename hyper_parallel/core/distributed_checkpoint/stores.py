"""The one place a checkpoint id picks its backend: :func:`store_for`. A third backend is one
more :class:`~.storage.CheckpointStore` class, chosen here."""

from __future__ import annotations

import os
from typing import ContextManager, Union

from hyper_parallel.core.distributed_checkpoint._fileio import url_scheme
from hyper_parallel.core.distributed_checkpoint.filesystem.folder import LocalStore
from hyper_parallel.core.distributed_checkpoint.object_store import store
from hyper_parallel.core.distributed_checkpoint.object_store.folder import ObjectStore
from hyper_parallel.core.distributed_checkpoint.storage import CheckpointStore

__all__ = ["startup_bounds", "store_for"]


def store_for(checkpoint_id: Union[str, os.PathLike]) -> CheckpointStore:
    """The store of ``checkpoint_id`` (a checkpoint, or a folder of ``step-N`` checkpoints): an
    :class:`ObjectStore` for an fsspec URL (``s3://bucket/run``, ``memory://...``,
    ``file://...``), else a :class:`LocalStore` for a local or mounted path.

    Raises:
        ValueError: a URL of a scheme fsspec does not know, or whose implementation is not installed.
    """
    checkpoint_id = os.fspath(checkpoint_id)
    return ObjectStore(checkpoint_id) if url_scheme(checkpoint_id) else LocalStore(checkpoint_id)


def startup_bounds() -> ContextManager[None]:
    """Within this block every request of an object store is bounded (10 s to connect and per
    read, 2 tries; a call ends after all of them): what a start-up check or a command-line tool
    uses, so that an endpoint that never answers is one line, not a hang. Outside it, requests
    follow the store's own defaults (long saves are not cut short)."""
    return store.bounded_requests(store.STARTUP_BOUNDS)
