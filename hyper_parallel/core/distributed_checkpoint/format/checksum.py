"""The checkpoint format's checksum: crc32 (zlib's polynomial), computed fast.

:func:`crc32` is ISA-L's crc32 (package ``isal``, 3-4x zlib's speed with the same values)
when importable, else zlib's; checkpoints written with either verify with the other. Without
``isal`` (an install with ``--no-deps``, or a platform without its wheel) the first checksum
of the process logs one warning, since saves and verified loads then cost several times the CPU.
:func:`crc32_combine` gives the crc32 of a whole file from the crc32s of its pieces,
without a second pass.
"""

from __future__ import annotations

import logging
import threading
import zlib
from typing import Callable, Tuple

_log = logging.getLogger(__name__)


def _fastest_crc32() -> Tuple[Callable[..., int], str]:
    """ISA-L's crc32 when ``isal`` is importable (a declared dependency), else zlib's."""
    try:
        from isal.isal_zlib import crc32 as fast
    except ImportError:
        return zlib.crc32, "zlib"
    return fast, "isal"


_crc32, CRC32_IMPLEMENTATION = _fastest_crc32()
"""Which library computes :func:`crc32` in this process (``"isal"`` or ``"zlib"``)."""
_slow_warned = False
_warn_lock = threading.Lock()


def describe_crc32() -> str:
    """The library behind :func:`crc32`, for reports (benchmarks print it)."""
    if CRC32_IMPLEMENTATION == "isal":
        return "crc32 by isal"
    return "crc32 by zlib (isal not importable: checksums cost ~7x the CPU of isal's)"


def _warn_slow_once() -> None:
    global _slow_warned
    with _warn_lock:
        if _slow_warned:
            return
        _slow_warned = True
    _log.warning("checkpoint checksums use zlib's crc32: the package 'isal' (a dependency of hyper_parallel) "
                 "is not importable, so saves and verified loads spend ~7x the CPU on checksums "
                 "(pip install isal; the values are the same)")


def crc32(data, value: int = 0) -> int:
    """crc32 of ``data`` (any buffer: bytes, memoryview, numpy array) continuing from the crc32
    ``value`` of the bytes before it. Releases the GIL while it runs on large buffers."""
    if CRC32_IMPLEMENTATION != "isal" and not _slow_warned:
        _warn_slow_once()
    return _crc32(data, value)


_POLY = 0xEDB88320


def _times(matrix: list, vector: int) -> int:
    total, i = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[i]
        vector >>= 1
        i += 1
    return total


def _square(matrix: list) -> list:
    return [_times(matrix, matrix[n]) for n in range(32)]


def _zero_byte_operators() -> list:
    # Operator k appends 2**k zero bytes to a crc (zlib's crc32_combine, precomputed once).
    one_bit = [_POLY] + [1 << n for n in range(31)]
    op = _square(_square(_square(one_bit)))  # 8 zero bits = 1 zero byte
    ops = []
    for _ in range(64):
        ops.append(op)
        op = _square(op)
    return ops


_OPS = _zero_byte_operators()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32 of ``a + b`` given ``crc32(a)``, ``crc32(b)`` and ``len(b)``."""
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(_OPS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2

