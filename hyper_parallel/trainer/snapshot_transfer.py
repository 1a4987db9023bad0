"""A snapshot folder's files on the wire: packed into one uint8 tensor, sent to another rank
over a (gloo) group, written out there; and the ranks' agreement on a part done."""

from __future__ import annotations

import json
import os
import struct
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from hyper_parallel.checkpoint import CheckpointError


def pack_folder(path: str) -> torch.Tensor:
    """The files of snapshot folder ``path`` as one uint8 tensor: an 8-byte header length, a JSON
    list of ``[name, size]``, then the files' bytes in that order."""
    names = sorted(os.listdir(path))
    sizes = [os.path.getsize(os.path.join(path, name)) for name in names]
    header = json.dumps([[n, s] for n, s in zip(names, sizes)]).encode()
    out = torch.empty(8 + len(header) + sum(sizes), dtype=torch.uint8)
    view = memoryview(out.numpy())
    view[:8] = struct.pack("<Q", len(header))
    view[8:8 + len(header)] = header
    at = 8 + len(header)
    for name, size in zip(names, sizes):
        with open(os.path.join(path, name), "rb") as f:
            if f.readinto(view[at:at + size]) != size:
                raise OSError(f"{os.path.join(path, name)} changed while it was being sent")
        at += size
    return out


def unpack_folder(payload: torch.Tensor, into: str) -> None:
    """Write the files of a :func:`pack_folder` payload into the empty folder ``into``."""
    view = memoryview(payload.numpy())
    (length,) = struct.unpack("<Q", view[:8])
    at = 8 + length
    for name, size in json.loads(bytes(view[8:at])):
        if os.path.basename(name) != name or name in (".", ".."):
            raise CheckpointError(f"a received snapshot names the file {name!r}")
        with open(os.path.join(into, name), "wb") as f:
            f.write(view[at:at + size])
        at += size


def transfer(sends: Sequence[Tuple[int, Optional[torch.Tensor]]], receive_from: Optional[int],
             group: dist.ProcessGroup) -> Optional[torch.Tensor]:
    """Send each ``(rank, payload)`` of ``sends`` while receiving one payload from rank
    ``receive_from`` (None: nothing to receive), over ``group``. A None payload is sent as
    "nothing"; a received "nothing" is returned as None."""
    sizes = [torch.tensor([-1 if payload is None else payload.numel()]) for _, payload in sends]
    size_in = torch.zeros(1, dtype=torch.int64)
    works = [dist.isend(size, dst=rank, group=group) for size, (rank, _) in zip(sizes, sends)]
    if receive_from is not None:
        works.append(dist.irecv(size_in, src=receive_from, group=group))
    for work in works:
        work.wait()
    works = [dist.isend(payload, dst=rank, group=group) for rank, payload in sends if payload is not None]
    received = None
    if receive_from is not None and size_in.item() >= 0:
        received = torch.empty(int(size_in.item()), dtype=torch.uint8)
        works.append(dist.irecv(received, src=receive_from, group=group))
    for work in works:
        work.wait()
    return received


def all_ranks_agree(ok: bool, group: dist.ProcessGroup) -> bool:
    """Whether ``ok`` holds on every rank of ``group`` (one all-reduce)."""
    flag = torch.tensor([int(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
