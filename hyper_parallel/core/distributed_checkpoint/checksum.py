"""crc32 of a whole file assembled from the crc32s of its pieces, without a second pass."""

from __future__ import annotations

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

