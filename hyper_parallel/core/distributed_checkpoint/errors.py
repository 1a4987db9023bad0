"""The checkpoint package's error type, imported by every layer below the public face, and how
a value read from a file appears in its messages."""

from __future__ import annotations

import dataclasses
import enum
import pathlib
from typing import Any, List

import torch

__all__ = ["CheckpointError", "short_repr"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or not loadable into the given state."""


_SHOWN_ITEMS, _SHOWN_DEPTH = 4, 3


def short_repr(value: Any, limit: int = 200) -> str:
    """``value`` as a message shows it: at most ``limit`` characters (then ``...``), at most
    four items per container and three levels deep, and never through ``repr`` of a container
    or an unknown object, so its cost stays bounded whatever a hostile file built (a list
    shared thousands of times, nesting thousands deep, a megabyte-long key)."""
    text = _shown(value, 0, limit)
    return text if len(text) <= limit else text[:limit] + "..."


def _shown(value: Any, depth: int, limit: int) -> str:
    if isinstance(value, (str, bytes, bytearray)):
        return repr(value[:limit]) + ("..." if len(value) > limit else "")
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return repr(value) if value.bit_length() <= 256 else f"<an int of {value.bit_length()} bits>"
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format, enum.Enum)):
        return repr(value)
    if isinstance(value, pathlib.PurePath):
        return f"{type(value).__name__}({_shown(str(value), depth, limit)})"
    if depth >= _SHOWN_DEPTH:
        return f"<a {type(value).__name__}>"
    if isinstance(value, dict):
        items = [f"{_shown(k, depth + 1, limit)}: {_shown(v, depth + 1, limit)}"
                 for k, v in _first(value.items())]
        return "{" + _joined(items, len(value)) + "}"
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_shown(v, depth + 1, limit) for v in _first(value)]
        opening, closing = {list: "[]", tuple: "()"}.get(type(value), f"{type(value).__name__}([])")[:-1], \
            {list: "]", tuple: ")"}.get(type(value), "])")
        single = "," if type(value) is tuple and len(value) == 1 else ""
        return opening + _joined(items, len(value)) + single + closing
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [f"{f.name}={_shown(getattr(value, f.name, '<missing>'), depth + 1, limit)}"
                 for f in dataclasses.fields(value)[:_SHOWN_ITEMS]]
        return f"{type(value).__name__}(" + _joined(items, len(dataclasses.fields(value))) + ")"
    return f"<a {type(value).__name__}>"


def _first(items: Any) -> List[Any]:
    out = []
    for item in items:
        if len(out) == _SHOWN_ITEMS:
            break
        out.append(item)
    return out


def _joined(items: List[str], total: int) -> str:
    return ", ".join(items) + (f", ... ({total} in all)" if total > len(items) else "")
