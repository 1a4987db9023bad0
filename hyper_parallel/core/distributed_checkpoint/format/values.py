"""Non-tensor values <-> bytes: JSON by default, pickle only when the caller opts in."""

from __future__ import annotations

import json
import pickle
from typing import Any

_TAG = "__hp__"


def _to_json_tree(value: Any, key: str) -> Any:
    # JSON has no tuples and only string dict keys; tag those so they come back as they went in.
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_to_json_tree(v, key) for v in value]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [_to_json_tree(v, key) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: _to_json_tree(v, key) for k, v in value.items()}
        return {_TAG: "dict", "items": [[_to_json_tree(k, key), _to_json_tree(v, key)] for k, v in value.items()]}
    raise TypeError(
        f"value of {key!r} has type {type(value).__name__}, which cannot be stored as JSON; "
        "convert it to plain data, or opt in to pickling with FileSystemWriter(..., allow_pickle=True)"
    )


MAX_VALUE_NESTING = 100  # lists/dicts inside a stored value


def _from_json_tree(node: Any, depth: int = 0) -> Any:
    if depth > MAX_VALUE_NESTING:
        raise ValueError(f"it nests deeper than {MAX_VALUE_NESTING} levels")
    depth += 1
    if isinstance(node, list):
        return [_from_json_tree(v, depth) for v in node]
    if isinstance(node, dict):
        tag = node.get(_TAG)
        if tag == "tuple":
            return tuple(_from_json_tree(v, depth) for v in node["items"])
        if tag == "dict":
            return {_hashable(_from_json_tree(k, depth)): _from_json_tree(v, depth) for k, v in node["items"]}
        return {k: _from_json_tree(v, depth) for k, v in node.items()}
    return node


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


def encode_value(value: Any, key: str, *, allow_pickle: bool) -> tuple[bytes, str]:
    """Serialise ``value``; returns ``(data, encoding)`` with encoding ``"json"`` or ``"pickle"``.

    Raises:
        TypeError: JSON cannot hold ``value`` and ``allow_pickle`` is False (names ``key``).
    """
    try:
        return json.dumps(_to_json_tree(value, key), allow_nan=True).encode(), "json"
    except TypeError:
        if not allow_pickle:
            raise
    return pickle.dumps(value), "pickle"


def decode_value(data: bytes, encoding: str, key: str, *, allow_pickle: bool) -> Any:
    """Inverse of :func:`encode_value`.

    Raises:
        ValueError: the stored value is pickled and ``allow_pickle`` is False, the encoding
            is unknown, or the JSON or pickle is corrupt (all name ``key``).
    """
    if encoding == "json":
        try:
            return _from_json_tree(json.loads(data))
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise ValueError(f"stored value of {key!r} is not valid JSON: {exc}") from None
    if encoding == "pickle":
        if not allow_pickle:
            raise ValueError(
                f"stored value of {key!r} is pickled; refusing to unpickle it. Opt in only for checkpoints "
                "you trust: FileSystemReader(..., allow_pickle=True), verify_checkpoint(..., allow_pickle=True), "
                "CLI verify --allow-pickle"
            )
        try:
            return pickle.loads(data)  # noqa: S301 - explicit opt-in by the caller
        except Exception as exc:  # a damaged pickle raises whatever its opcodes lead to
            raise ValueError(f"stored value of {key!r} is not a valid pickle: {type(exc).__name__}: {exc}") from None
    raise ValueError(f"stored value of {key!r} has unknown encoding {encoding!r}")
