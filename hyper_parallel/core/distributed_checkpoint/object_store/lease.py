"""One job per object-store folder: a lease object ``folder/.hyper_parallel.lock``.

Object stores have no ``flock``. The lock is an object holding the holder (pid and host), a
random token, the time it was last renewed and the lease length:

- taken by a conditional create (S3: ``If-None-Match: *``, one request: of two jobs starting
  together exactly one gets it);
- renewed by its holder every ``lease_s / 4`` seconds (a background thread; S3: a PUT with
  ``If-Match`` on the holder's last ETag, so a renewal never overwrites another job's lock);
- released (deleted) by ``CheckpointManager.close()``, when the manager is collected, or at
  interpreter exit. A killed job's lease stops being renewed: another job takes it over after
  watching it unchanged for the rest of its lease (``lease_s`` minus its age by the time stamp,
  at least ``lease_s / 2``: clocks may disagree; S3: the takeover is a PUT with ``If-Match`` on
  the stale ETag, so one job wins);
- a holder whose renewal finds another job's lock (or that could not renew for ``lease_s``)
  has lost it: its manager refuses the next save;
- the fence (:func:`fence`): right before a save's commit PUT and before deleting objects of
  other saves, the holder renews the lease once more, conditional on its last version. A job
  that stalled past its lease (``SIGSTOP``, a swapping host) and was taken over finds the other
  job's lock there and raises instead of replacing that job's checkpoint. A renewal that the
  store does not answer counts only while less than half a lease passed since the last one
  (no other job can have judged the lease dead before that). What remains is a stall of more
  than half a lease between that renewal and the PUT right after it.

On stores without conditional requests (``ObjectOps.atomic`` False: gcsfs, adlfs through
fsspec's generic create) create and takeover are check-then-write: two jobs starting within
one request's time can both believe they hold the folder until the next renewal, where the
loser sees the other token and stops saving.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Dict, Optional

from hyper_parallel.core.distributed_checkpoint.errors import CheckpointError
from hyper_parallel.core.distributed_checkpoint.object_store.conditional import ObjectOps, Version

LOCK_OBJECT = ".hyper_parallel.lock"
LEASE_S = 60.0
"""Seconds a lease lasts without renewal (renewed every quarter of it)."""
_log = logging.getLogger(__name__)


class LeaseState(enum.Enum):
    HELD = "held"
    LOST = "lost"
    RELEASED = "released"


def _parse(data: bytes) -> Optional[Dict[str, Any]]:
    try:
        info = json.loads(data)
        if isinstance(info, dict) and isinstance(info.get("renewed"), (int, float)) \
                and isinstance(info.get("lease_s"), (int, float)):
            return info
    except ValueError:
        pass
    return None


class FolderLease:
    """The lease of ``url`` (path ``path`` on ``ops``'s file system) for this process."""

    def __init__(self, ops: ObjectOps, path: str, url: str, lease_s: Optional[float] = None) -> None:
        self.ops, self.url = ops, url
        self.object = f"{path}/{LOCK_OBJECT}"
        self.lease_s = LEASE_S if lease_s is None else lease_s
        self.token = uuid.uuid4().hex
        self.holder = f"pid {os.getpid()} on {socket.gethostname()}"
        self.state = LeaseState.RELEASED
        self.lost_reason = ""
        self._version: Version = None
        self._renewed = 0.0  # time.monotonic() when the request that made ``_version`` was sent
        self._lock = threading.Lock()  # one conditional write at a time: renewals, fences
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _body(self) -> bytes:
        return json.dumps({"holder": self.holder, "token": self.token, "renewed": time.time(),
                           "lease_s": self.lease_s}).encode()

    def acquire(self) -> Optional[str]:
        """Take the lease; None, or a sentence saying which job holds the folder."""
        for _ in range(8):  # each round ends in a decision unless the lock changed hands meanwhile
            sent = time.monotonic()
            version = self.ops.create(self.object, self._body())
            if version is not None:
                return self._start(version, sent)
            current = self.ops.read(self.object)
            if current is None:
                continue  # released meanwhile
            data, seen = current
            info = _parse(data)
            if info is None:
                return (f"{self.url}/{LOCK_OBJECT} is not a lock of this library; delete it if no job uses "
                        f"{self.url}")
            if self._still_renewed(info, seen):
                return (f"{self.url} is in use by another job ({info.get('holder', 'unknown')}, lock renewed "
                        f"{time.time() - info['renewed']:.0f}s ago); two jobs must not write checkpoints into "
                        "one folder: use another folder, or stop the other job")
            sent = time.monotonic()
            version = self.ops.replace(self.object, self._body(), seen)
            if version is not None:
                _log.warning("took over %s/%s from %s: its lease expired (a job that ended without releasing "
                             "it, or one stalled for longer than its lease)", self.url, LOCK_OBJECT,
                             info.get("holder", "unknown"))
                return self._start(version, sent)
        return f"{self.url}/{LOCK_OBJECT} keeps changing hands; is another job starting on {self.url}?"

    def _still_renewed(self, info: Dict[str, Any], seen: Version) -> bool:
        """Watch a lock for what is left of its lease: True as soon as its holder renews it.
        Its time stamp shortens the watch by at most half a lease (clocks may disagree), so
        a live holder is always seen renewing (every quarter lease) before it is judged dead."""
        lease = min(float(info["lease_s"]), 4 * self.lease_s)  # a foreign lease length is bounded
        age = min(max(time.time() - float(info["renewed"]), 0.0), lease / 2)
        end = time.monotonic() + lease - age
        _log.warning("%s is locked by %s: waiting up to %.0fs to see whether that job is alive", self.url,
                     info.get("holder", "unknown"), lease - age)
        while time.monotonic() < end:
            time.sleep(min(lease / 16, max(end - time.monotonic(), 0.0)))
            current = self.ops.read(self.object)
            if current is None or current[1] != seen:
                return current is not None  # renewed (alive), or released (free: try again)
        return False

    def _start(self, version: Version, sent: float) -> None:
        self._version, self._renewed, self.state = version, sent, LeaseState.HELD
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, name="hyper_parallel-lease", daemon=True)
        self._thread.start()
        return None

    def _renew(self) -> bool:
        """One renewal conditional on this job's last version (``_lock`` held): True when
        renewed, False when another job's lock is there (the lease is then lost). Raises
        what the store raised."""
        sent = time.monotonic()
        version = self.ops.replace(self.object, self._body(), self._version)
        if version is None:
            self._lose(f"another job replaced it ({self._holder_now()}; this job's lease ran out: it stalled or "
                       "could not reach the store for longer than the lease)")
            return False
        self._version, self._renewed = version, sent
        return True

    def _holder_now(self) -> str:
        try:
            current = self.ops.read(self.object)
        except Exception:  # noqa: BLE001 (only for the message)
            return "holder unknown"
        if current is None:
            return "none now: the lock object is gone"
        info = _parse(current[0])
        return str(info.get("holder", "holder unknown")) if info else "not a lock of this library"

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            with self._lock:
                if self.state is not LeaseState.HELD:
                    return
                try:
                    if not self._renew():
                        return
                except Exception as exc:  # noqa: BLE001 (an unreachable store: retried until the lease ends)
                    if time.monotonic() - self._renewed > self.lease_s:
                        self._lose(f"could not renew it for {self.lease_s:.0f}s ({exc})")
                        return

    def confirm(self) -> None:
        """The fence: renew the lease now, conditional on this job's last version.

        Raises:
            CheckpointError: the lease is lost (another job's lock is there, named), or the
                store did not answer and half a lease has passed since the last renewal.
        """
        with self._lock:
            if self.state is not LeaseState.HELD:
                raise CheckpointError(self.problem())
            try:
                if self._renew():
                    return
            except Exception as exc:  # noqa: BLE001 (the store's errors, whatever they are)
                if time.monotonic() - self._renewed < self.lease_s / 2:
                    return  # no other job can have judged this lease dead yet
                raise CheckpointError(f"could not confirm the lock {self.url}/{LOCK_OBJECT} ({type(exc).__name__}: "
                                      f"{exc}) and its last renewal is {time.monotonic() - self._renewed:.0f}s old: "
                                      "another job may hold the folder now") from None
            raise CheckpointError(self.problem())

    def problem(self) -> str:
        """Why this process does not hold the lease (once lost)."""
        return f"lost the lock {self.url}/{LOCK_OBJECT}: {self.lost_reason}"

    def _lose(self, why: str) -> None:
        self.state, self.lost_reason = LeaseState.LOST, why
        _log.error("lost the lock of checkpoint folder %s: %s; this job saves no more checkpoints there",
                   self.url, why)

    def release(self) -> None:
        """Stop renewing and delete the lock object if it is still ours."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            if self.state is LeaseState.HELD:
                try:
                    self.ops.delete(self.object, self._version)
                except Exception as exc:  # noqa: BLE001 (at exit: the lease then expires by itself)
                    _log.warning("could not delete %s/%s (%s): it expires after %.0fs", self.url, LOCK_OBJECT, exc,
                                 self.lease_s)
            self.state = LeaseState.RELEASED


# url -> [lease, managers of this process using it]: managers within one process share the lease
_HELD: Dict[str, list] = {}
_HELD_LOCK = threading.Lock()


def acquire_folder(ops: ObjectOps, path: str, url: str) -> Optional[str]:
    """Take (or share, within this process) the lease of ``url``; None or a refusal sentence."""
    with _HELD_LOCK:
        held = _HELD.get(url)
        if held is not None and held[0].state is LeaseState.HELD:
            held[1] += 1
            return None
        lease = FolderLease(ops, path, url)
        refusal = lease.acquire()
        if refusal is None:
            _HELD[url] = [lease, 1]
        return refusal


def release_folder(url: str) -> None:
    """Drop this process's use of ``url``'s lease; the last user releases it."""
    with _HELD_LOCK:
        held = _HELD.get(url)
        if held is None:
            return
        held[1] -= 1
        if not held[1]:
            del _HELD[url]
            held[0].release()


def lease_problem(url: str) -> Optional[str]:
    """Why this process no longer holds ``url``'s lease, or None while it does."""
    held = _HELD.get(url)
    if held is None or held[0].state is LeaseState.HELD:
        return None
    return held[0].problem()


def fence(url: str, doing: str) -> None:
    """Before ``doing`` (a commit, a deletion) under ``url``: when this process holds (or
    held and lost) the lease of a folder containing ``url``, confirm it
    (:meth:`FolderLease.confirm`). Elsewhere (no lease of this process) nothing is checked.

    Raises:
        CheckpointError: ``refusing to <doing>: lost the lock ...`` naming the other holder.
    """
    with _HELD_LOCK:
        held = next((entry[0] for folder, entry in _HELD.items()
                     if url == folder or url.startswith(folder + "/")), None)
    if held is None:
        return
    try:
        held.confirm()
    except CheckpointError as exc:
        raise CheckpointError(f"refusing to {doing}: {exc}; this job saves no more checkpoints there") from None
