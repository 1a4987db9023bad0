"""Where ``import_dcp`` / ``export_dcp`` may write: never onto their source, never over a
folder that holds anything but a checkpoint of the kind they write (and that one only with
``force``), never through a symbolic link planted in the destination.

A local destination is written as a fresh staging folder next to it (created empty by us, so
nothing in it can be a planted link) and renamed into place once complete; an fsspec URL
(``memory://``, ``s3://``) has no rename: the writer's own commit point (the metadata object,
written last) makes it a checkpoint.
"""

from __future__ import annotations

import contextlib
import enum
import os
import re
import shutil
import stat
import uuid
from typing import Any, Iterator, List, Optional, Tuple

from hyper_parallel.core.distributed_checkpoint._fileio import replace_dir, url_scheme
from hyper_parallel.utils.fileio import read_regular_file
from hyper_parallel.core.distributed_checkpoint.dcp_interop.unpickler import DCP_METADATA_FILE, read_dcp_metadata
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError, short_repr
from hyper_parallel.core.distributed_checkpoint.filesystem.commit import RANK_METADATA, pending_dir
from hyper_parallel.core.distributed_checkpoint.format.metadata import MAX_METADATA_BYTES, METADATA_FILE, Metadata
from hyper_parallel.core.distributed_checkpoint.object_store import store

__all__ = ["DestinationRefused", "OutputKind", "check_destination", "staged_output"]

# Entries of a checkpoint folder of each kind (a checkpoint of ours names its data files in
# its metadata; these patterns are what our writers and torch's FileSystemWriter name them).
_OURS_ENTRY = re.compile(r"metadata(\.rank\d+)?\.json|__\d+(_\d+)?(\.[0-9a-f]{32})?\.(safetensors|values\.json|values\.pkl)")
_DCP_ENTRY = re.compile(r"\.metadata|__\d+_\d+\.distcp")


class DestinationRefused(CheckpointError):
    """The destination of a conversion is refused (its source, or a folder that is not empty
    and not a checkpoint of the kind written); nothing was written."""


class OutputKind(enum.Enum):
    """What a conversion writes, and so what ``force`` may replace."""

    OURS = "checkpoint of ours"
    DCP = "torch DCP checkpoint"

    def holds(self, names: List[str]) -> Optional[str]:
        """None if ``names`` (a folder's entries) are those of a checkpoint of this kind, else
        the first entry that is not."""
        commit_file, pattern = (METADATA_FILE, _OURS_ENTRY) if self is OutputKind.OURS else (DCP_METADATA_FILE, _DCP_ENTRY)
        if self is OutputKind.OURS and RANK_METADATA.format(0) in names:
            commit_file = RANK_METADATA.format(0)
        if commit_file not in names:
            return f"no {commit_file}"
        return next((repr(name) for name in sorted(names) if not pattern.fullmatch(name)), None)

    def marked(self, dst: str, names: List[str]) -> Optional[str]:
        """None if the commit file in ``dst`` (whose entries ``names`` passed :meth:`holds`) is
        one of this kind (ours: a ``metadata.json`` of our format; DCP: a ``.metadata`` DCP's
        restricted reader accepts), else why not: file names alone never make a folder ours."""
        try:
            if self is OutputKind.DCP:
                read_dcp_metadata(dst)
                return None
            name = RANK_METADATA.format(0) if RANK_METADATA.format(0) in names else METADATA_FILE
            if url_scheme(dst):
                fs, path = store.open_store(dst)
                data = fs.cat_file(f"{path}/{name}")
            else:
                data = read_regular_file(os.path.join(dst, name), MAX_METADATA_BYTES, "checkpoint metadata")
            Metadata.from_json(data, name)
            return None
        except (CheckpointError, OSError, ValueError) as exc:
            return f"its metadata is not a {self.value}'s: {short_repr(str(exc))}"


def _local_entries(dst: str) -> Optional[List[str]]:
    """The names in the existing folder ``dst`` (None: it does not exist); refuses anything
    else at ``dst`` and entries that are not regular files (links are never followed)."""
    try:
        mode = os.lstat(dst).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        raise DestinationRefused(f"destination {dst} is a symbolic link; give the folder it points to")
    if not stat.S_ISDIR(mode):
        raise DestinationRefused(f"destination {dst} exists and is not a folder")
    names = os.listdir(dst)
    for name in names:
        if not stat.S_ISREG(os.lstat(os.path.join(dst, name)).st_mode):
            raise DestinationRefused(f"destination {dst} is not empty and holds {name!r}, which is not a file of a "
                                     "checkpoint; refusing to replace it (choose a new or empty folder)")
    return names


def _url_entries(dst: str) -> Tuple[Any, str, Optional[List[str]]]:
    fs, path = store.open_store(dst)
    names = store.list_names(fs, path)
    return fs, path, names or None


def _same_place(src: str, dst: str) -> bool:
    if bool(url_scheme(src)) != bool(url_scheme(dst)):
        return False
    if url_scheme(src):
        (src_fs, src_path), (dst_fs, dst_path) = store.open_store(src), store.open_store(dst)
        return type(src_fs) is type(dst_fs) and src_path == dst_path
    if os.path.realpath(src) == os.path.realpath(dst):
        return True
    try:
        return os.path.samefile(src, dst)
    except OSError:
        return False


def check_destination(src: str, dst: str, kind: OutputKind, force: bool) -> Optional[List[str]]:
    """Refuse ``dst`` unless it is new, empty, or (with ``force``) a checkpoint of ``kind``;
    returns its entries (None where it does not exist or is empty).

    Raises:
        DestinationRefused: ``dst`` is ``src`` (also through a link or another spelling),
            is not a folder, holds anything but a checkpoint of ``kind``, or is one and
            ``force`` is not given.
    """
    if _same_place(src, dst):
        raise DestinationRefused(f"destination {dst} is the source {src}; write the conversion somewhere else")
    names = _url_entries(dst)[2] if url_scheme(dst) else _local_entries(dst)
    if not names:
        return None
    stranger = kind.holds(names)
    if stranger is not None:
        raise DestinationRefused(f"destination {dst} is not empty and is not a {kind.value} ({stranger}); refusing "
                                 "to replace it (choose a new or empty folder)")
    stranger = kind.marked(dst, names)
    if stranger is not None:
        raise DestinationRefused(f"destination {dst} is not empty and is not a {kind.value} ({stranger}); refusing "
                                 "to replace it (choose a new or empty folder)")
    if not force:
        raise DestinationRefused(f"destination {dst} already holds a {kind.value}; pass --force (force=True) to "
                                 "replace it")
    return names


@contextlib.contextmanager
def staged_output(src: str, dst: str, kind: OutputKind, force: bool) -> Iterator[str]:
    """Check ``dst`` (:func:`check_destination`) and yield where to write it: a fresh empty
    staging folder next to a local ``dst``, renamed onto it when the block completes (and
    removed if it fails); a URL itself, after the replaced checkpoint's objects are removed
    (``force``: object stores have no rename)."""
    names = check_destination(src, dst, kind, force)
    if url_scheme(dst):
        fs, path, _ = _url_entries(dst)
        if names:
            fs.rm([f"{path}/{name}" for name in names])
        yield dst
        return
    staging = pending_dir(os.path.abspath(dst), uuid.uuid4().hex)
    os.makedirs(os.path.dirname(staging), exist_ok=True)
    os.mkdir(staging)
    try:
        yield staging
        replace_dir(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
