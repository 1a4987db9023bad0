"""Byte counts for people."""

from __future__ import annotations


def format_bytes(n: float, digits: int = 0, sep: str = "") -> str:
    """``n`` bytes in B, KiB, MiB, GiB or TiB: ``"341MiB"``; with ``digits=2, sep=" "``:
    ``"64.00 KiB"``. Bytes are whole (``"12 B"``); TiB get at least one decimal."""
    if n < 1024:
        return f"{n:.0f}{sep}B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.{digits}f}{sep}{unit}"
    return f"{n / 1024:.{max(digits, 1)}f}{sep}TiB"
