"""Nested state dicts <-> flat ``{"a.b.c": leaf}`` dicts, the keys metadata is stored under."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Tuple

import torch

Path = Tuple[Any, ...]


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    if isinstance(value, list):
        return any(_holds_tensor(v) for v in value)
    return False


def flatten_state_dict(state_dict: Mapping[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Path]]:
    """Flatten nested dicts (and lists that hold tensors) into ``"."``-joined keys.

    Returns the flat dict and, per flat key, the path of keys/indices into ``state_dict``.
    Leaves are tensors and any other value (empty containers and tensor-free lists stay whole).

    Raises:
        ValueError: two paths flatten to the same key (e.g. ``{"a.b": x, "a": {"b": y}}``).
    """
    flat: Dict[str, Any] = {}
    paths: Dict[str, Path] = {}

    def visit(value: Any, path: List[Any]) -> None:
        nested = (isinstance(value, Mapping) and value) or (isinstance(value, list) and _holds_tensor(value))
        if path and not nested:
            key = ".".join(str(p) for p in path)
            if key in flat:
                raise ValueError(f"state dict keys {paths[key]} and {tuple(path)} both flatten to {key!r}")
            flat[key], paths[key] = value, tuple(path)
            return
        items = value.items() if isinstance(value, Mapping) else enumerate(value)
        for k, v in items:
            visit(v, path + [k])

    visit(state_dict, [])
    return flat, paths


def set_by_path(root: Any, path: Path, value: Any) -> None:
    """Replace the leaf at ``path`` inside ``root`` (the nested dict ``path`` came from)."""
    parent = root
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
