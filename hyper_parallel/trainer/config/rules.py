"""What a config value may be, declared next to its dataclass field, and the checks that follow.

A schema field is ``name: <type> = key(default, <range>)``: the type comes from the annotation
(``int``, ``float``, ``bool``, ``str``, ``Optional[...]``, ``List[...]``, ``Union[str,
List[str]]``, ``Optional[<dataclass>]``: null or a mapping of its keys), the range from
:func:`key`'s arguments. :func:`value_problem` judges one value against both and says what a valid value is, e.g. ``training.steps=-5 must be a positive
integer``. Values are judged here, after composition, not by OmegaConf while composing, so that
every bad value is reported together with every other problem.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

from omegaconf import MISSING

_NONE = type(None)


@dataclasses.dataclass(frozen=True)
class Range:
    """The range of a value (of each item, for a list) and, for a list, its length.

    ``*_open``: the bound itself is excluded. ``path``: a string that names a file or folder.
    ``choices``: the only strings accepted. ``length``: a list of exactly that many items;
    ``allow_empty``: an empty list is valid.
    """

    min: Optional[float] = None
    max: Optional[float] = None
    min_open: bool = False
    max_open: bool = False
    path: bool = False
    choices: Tuple[str, ...] = ()
    length: Optional[int] = None
    allow_empty: bool = False


def key(default: Any = MISSING, **range_: Any) -> Any:
    """A schema field: its default (``MISSING``: the user must set it) and its :class:`Range`."""
    meta = {"range": Range(**range_)}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def optional_dataclass(hint: Any) -> Optional[type]:
    """``D`` of a field typed ``Optional[D]`` with ``D`` a dataclass (a key that is null or a
    mapping of ``D``'s fields, e.g. ``model.rope_scaling``); None for any other type."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Union and len(args) == 2 and _NONE in args:
        inner = args[0] if args[1] is _NONE else args[1]
        return inner if dataclasses.is_dataclass(inner) else None
    return None


def field_rules(cls: type) -> Dict[str, Tuple[Any, Range]]:
    """``name -> (type annotation, Range)`` of a schema dataclass's plain (non-dataclass) fields;
    an ``Optional[dataclass]`` field has its own rule (null) and one per nested key
    (``name.key``)."""
    hints = typing.get_type_hints(cls)
    rules = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            continue
        rules[f.name] = (hint, f.metadata.get("range", Range()))
        nested = optional_dataclass(hint)
        if nested is not None:
            rules.update({f"{f.name}.{name}": rule for name, rule in field_rules(nested).items()})
    return rules


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bounds(r: Range) -> str:
    if r.min is not None and r.max is not None:
        return f" in {'(' if r.min_open else '['}{r.min}, {r.max}{')' if r.max_open else ']'}"
    if r.min is not None:
        return f" {'>' if r.min_open else '>='} {r.min}"
    if r.max is not None:
        return f" {'<' if r.max_open else '<='} {r.max}"
    return ""


def _in_range(value: float, r: Range) -> bool:
    above = r.min is None or (value > r.min if r.min_open else value >= r.min)
    below = r.max is None or (value < r.max if r.max_open else value <= r.max)
    return above and below


def accepts(hint: Any, r: Range, value: Any) -> bool:
    """Whether ``value`` is of type ``hint`` and in range ``r``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return False  # a mapping's keys are judged one by one (leaves); any other value is wrong
    if origin is Union:
        return any(accepts(arg, r, value) if arg is not _NONE else value is None for arg in args)
    if origin in (list, List):
        if not isinstance(value, (list, tuple)) or not (value or r.allow_empty):
            return False
        return (r.length is None or len(value) == r.length) and all(accepts(args[0], r, v) for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return _is_int(value) and _in_range(value, r)
    if hint is float:
        return (_is_int(value) or isinstance(value, float)) and math.isfinite(value) and _in_range(value, r)
    if hint is str:
        if r.choices:
            return isinstance(value, str) and value in r.choices
        return isinstance(value, str) and value.strip() != ""
    raise TypeError(f"unsupported schema type {hint!r}")


def describe(hint: Any, r: Range) -> str:
    """What a valid value is, completing "must be ..."."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return "a mapping of " + ", ".join(f.name for f in dataclasses.fields(hint))
    if origin is Union:
        described = [describe(arg, r) for arg in args if arg is not _NONE]
        return ("null or " if _NONE in args else "") + ", or ".join(described)
    if origin in (list, List):
        count = f"{r.length} " if r.length else ""
        return f"a list of {count}values, each {describe(args[0], r)}"
    if hint is bool:
        return "true or false"
    if hint is int:
        return "a positive integer" if (r.min, r.max) == (1, None) else "an integer" + _bounds(r)
    if hint is float:
        return "a finite number" + _bounds(r)
    if r.choices:
        return "one of " + ", ".join(r.choices)
    return "a path" if r.path else "a non-empty string"


def leaves(node: Dict[str, Any], prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """(dotted key, value) of every leaf of a plain nested dict; lists are leaves."""
    for name, value in node.items():
        if isinstance(value, dict):
            yield from leaves(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def defaults(cls: type, exclude: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """The defaults of a schema dataclass as a plain nested dict (``???`` where none)."""
    return {k: v for k, v in dataclasses.asdict(cls()).items() if k not in exclude}


def build(cls: type, values: Dict[str, Any], pick: Optional[Any] = None) -> Any:
    """An instance of schema ``cls`` from a plain nested dict, values as given (not converted:
    validation judges them). ``pick(hint, values)`` chooses the class of a nested dataclass
    field (e.g. the data kind's); keys the schema lacks are left out."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        value, hint = values[f.name], hints[f.name]
        if dataclasses.is_dataclass(hint):
            sub = pick(hint, value) if pick is not None else hint
            if sub is None or not isinstance(value, dict):
                continue
            value = build(sub, value, pick)
        elif optional_dataclass(hint) is not None and isinstance(value, dict):
            value = build(optional_dataclass(hint), value, pick)
        kwargs[f.name] = value
    return cls(**kwargs)
