"""A snapshot folder's files on the wire: sent to another rank over a (gloo) group straight from
their pages and received straight into the files of a folder there (both sides map the files:
no copy in user space); and the ranks' agreement on a part done."""

from __future__ import annotations

import json
import logging
import os
from typing import Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hyper_parallel.checkpoint import CheckpointError

_log = logging.getLogger(__name__)


class MappedFolder(NamedTuple):
    """The files of a snapshot folder, mapped for sending: their ``[name, size]`` list and
    their bytes (one uint8 tensor a non-empty file, in that order)."""

    files: List[Tuple[str, int]]
    data: List[torch.Tensor]

    @classmethod
    def of(cls, path: str) -> "MappedFolder":
        """Map the files of ``path`` (all of them now: what is sent is fixed before the
        header goes out).

        Raises:
            OSError: the folder or a file cannot be read.
        """
        files = [(name, os.path.getsize(os.path.join(path, name))) for name in sorted(os.listdir(path))]
        data = [torch.from_file(os.path.join(path, name), shared=False, size=size, dtype=torch.uint8)
                for name, size in files if size]
        return cls(files, data)

    def header(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(json.dumps(self.files).encode()), dtype=torch.uint8)


def mapped_or_nothing(path: str) -> Optional[MappedFolder]:
    """``MappedFolder.of(path)``, or None (sent as "nothing") when it cannot be read (logged)."""
    try:
        return MappedFolder.of(path)
    except OSError as err:
        _log.warning("cannot send the memory snapshot %s: %s", path, err)
        return None


def _mapped_file(path: str, size: int) -> torch.Tensor:
    """A new file of ``size`` bytes at ``path``, its space reserved now (a full tmpfs fails
    here, not as a SIGBUS while receiving), mapped as a uint8 tensor."""
    with open(path, "wb") as f:
        if size:
            os.posix_fallocate(f.fileno(), 0, size)
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


def _received_files(header: torch.Tensor, into: Optional[str]) -> Tuple[List[torch.Tensor], Optional[Exception]]:
    """Buffers for the files a received ``header`` announces, in order: each mapped onto its
    file in the empty folder ``into``, or, for a name that is not a plain file name or a file
    that cannot be made (``into`` None), a scratch buffer (the bytes are still received: the
    sender's sends complete) and the error to raise afterwards."""
    buffers, problem = [], None
    for name, size in json.loads(bytes(header.numpy())):
        try:
            if into is None:
                raise OSError("no folder to receive a snapshot into")
            if os.path.basename(name) != name or name in (".", ".."):
                raise CheckpointError(f"a received snapshot names the file {name!r}")
            buffers.append(_mapped_file(os.path.join(into, name), size))
        except (OSError, CheckpointError) as err:
            problem = problem or err
            buffers.append(torch.empty(size, dtype=torch.uint8))
    return [b for b in buffers if b.numel()], problem


def _exchange(sends: Sequence[Tuple[int, torch.Tensor]], receives: Sequence[Tuple[int, torch.Tensor]],
              group: dist.ProcessGroup) -> None:
    """Post every send and receive over ``group``, then wait for all of them."""
    works = [dist.isend(t, dst=rank, group=group) for rank, t in sends]
    works += [dist.irecv(t, src=rank, group=group) for rank, t in receives]
    for work in works:
        work.wait()


def transfer(sends: Sequence[Tuple[int, Optional[MappedFolder]]], receive_from: Optional[int],
             into: Callable[[], str], group: dist.ProcessGroup) -> Optional[str]:
    """Send each ``(rank, folder)`` of ``sends`` while receiving one folder's files from rank
    ``receive_from`` (None: nothing to receive) into the empty folder ``into()`` makes, over
    ``group``. A None folder is sent as "nothing". Returns the folder received into, or None
    when "nothing" came.

    Raises:
        CheckpointError: the received files name a path; OSError: they cannot be made (both
            once every byte was received, so the group stays usable).
    """
    headers = [(rank, None if folder is None else folder.header()) for rank, folder in sends]
    lengths = [(rank, torch.tensor([-1 if h is None else h.numel()])) for rank, h in headers]
    length_in = torch.zeros(1, dtype=torch.int64)
    _exchange(lengths, [] if receive_from is None else [(receive_from, length_in)], group)
    header_in = None if receive_from is None or length_in.item() < 0 else torch.empty(int(length_in.item()),
                                                                                      dtype=torch.uint8)
    _exchange([(rank, h) for rank, h in headers if h is not None],
              [] if header_in is None else [(receive_from, header_in)], group)
    folder, buffers, problem = None, [], None
    if header_in is not None:
        try:
            folder = into()
        except OSError as err:
            problem = err
        buffers, unmade = _received_files(header_in, folder)
        problem = problem or unmade
    _exchange([(rank, t) for rank, f in sends if f is not None for t in f.data],
              [(receive_from, b) for b in buffers], group)
    del buffers  # unmapped: the files hold the bytes
    if problem is not None:
        raise problem
    return folder


def all_ranks_agree(ok: bool, group: dist.ProcessGroup) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (one all-reduce)."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
