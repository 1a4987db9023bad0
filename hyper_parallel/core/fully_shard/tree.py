"""Walk and rebuild nested forward inputs/outputs (tensors in dicts, lists, tuples, dataclasses)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import torch


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj``."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name))
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from iter_tensors(value)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)`` (containers rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(fn, getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, dict):
        return type(obj)((key, map_tensors(fn, value)) for key, value in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, value) for value in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, value) for value in obj)
    return obj


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with floating-point tensors cast to ``dtype``."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, obj)
