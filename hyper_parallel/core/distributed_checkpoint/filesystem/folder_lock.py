"""One job per checkpoint folder on a file system: rank 0's exclusive ``flock`` on
``folder/.hyper_parallel.lock`` (released when its file descriptor closes, also on ``kill -9``).
Object-store folders use a lease object instead (``object_store/lease.py``)."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
from typing import Dict, List, Optional

from hyper_parallel.core.distributed_checkpoint._fileio import open_regular
from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError

LOCK_FILE = ".hyper_parallel.lock"
_log = logging.getLogger(__name__)
# folder (real path) -> [lock fd, managers of this process using it]
_HELD: Dict[str, List[int]] = {}


def lock_folder(folder: str) -> Optional[str]:
    """Take ``folder``'s writer lock for this process (shared by its managers); None on
    success, else a sentence naming the holder. The OS drops the lock when the process ends."""
    key = os.path.realpath(folder)
    held = _HELD.get(key)
    if held is not None:
        held[1] += 1
        return None
    try:  # never through a symbolic link or into a file with other names: we truncate it below
        fd = open_regular(os.path.join(folder, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o666)
    except CheckpointError as exc:
        return f"cannot lock {folder}: {exc}"
    except OSError as exc:  # e.g. a read-only folder, used only to resume from
        _log.warning("cannot lock %s (%s): a second job on this folder would not be detected", folder, exc)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        return (f"{folder} is in use by another job ({holder}); two jobs must not write checkpoints "
                "into one folder: use another folder, or stop the other job")
    except OSError as exc:  # a file system without flock (ENOLCK, ENOSYS): work unlocked
        os.close(fd)
        _log.warning("cannot lock %s (%s): a second job on this folder would not be detected", folder, exc)
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
    _HELD[key] = [fd, 1]
    return None


def unlock_folder(folder: str) -> None:
    key = os.path.realpath(folder)
    held = _HELD.get(key)
    if held is not None:
        held[1] -= 1
        if not held[1]:
            del _HELD[key]
            os.close(held[0])  # releases the flock
