"""docs/recipes.md's key tables against the config schema: every key has a row, every row names
a key, and a default the table states is the schema's.

How the tables are written: a key table's header starts with ``key`` (``| key | meaning |`` or
``| key | default | meaning |``), the data table's with ``option`` (``| option | keys | what |``:
one row per ``data`` kind, its keys listed as ``name`` or ``name`` (note), comma-separated).
Under a heading ``### `GROUP` ...`` of a config group the keys are the group's (``tp`` is
``parallel.tp``); elsewhere they are whole (``training.steps``). One row may name several keys,
``a``, ``b``, with as many defaults, ``3, 2``; a note after a default, ``null (`tensorwise`)``,
explains it. A mapping's row (``rope_scaling``) stands for its nested keys.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import yaml

from hyper_parallel.trainer.config.compose import all_keys
from hyper_parallel.trainer.config.rules import leaves
from hyper_parallel.trainer.config.data import DATA_KEYS
from hyper_parallel.trainer.config.schema import GROUPS, TrainConfig

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "recipes.md")
_BACKTICKED = re.compile(r"`([^`]+)`")
_CELL_SEPARATOR = re.compile(r"(?<!\\)\|")  # a pipe that is not escaped (`<\|endoftext\|>`)


class Row(NamedTuple):
    heading: str
    cells: List[str]
    columns: List[str]


def _cells(line: str) -> List[str]:
    return [cell.strip() for cell in _CELL_SEPARATOR.split(line.strip()[1:-1])]


def doc_rows(text: str, first_column: str) -> Iterator[Row]:
    """The rows of the tables whose header's first column is ``first_column``, with the heading
    they stand under."""
    lines, heading = text.splitlines(), ""
    for i, line in enumerate(lines):
        if line.startswith("#"):
            heading = line
        is_header = line.startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---")
        if not is_header or _cells(line)[0] != first_column:
            continue
        columns = _cells(line)
        for row in lines[i + 2:]:
            if not row.startswith("|"):
                break
            yield Row(heading, _cells(row), columns)


def _group(heading: str) -> Optional[str]:
    """``G`` of a heading ``### `G` ...`` naming a config group, else None (whole keys)."""
    match = re.match(r"#+ `(\w+)`", heading)
    return match.group(1) if match and match.group(1) in GROUPS else None


def key_rows(text: str) -> Iterator[Tuple[List[str], Optional[str]]]:
    """(the whole keys a row names, its default cell or None) of every key table."""
    for row in doc_rows(text, "key"):
        group = _group(row.heading)
        names = _BACKTICKED.findall(row.cells[0])
        assert names, f"a row under {row.heading!r} names no key: {row.cells[0]!r}"
        keys = [f"{group}.{name}" if group else name for name in names]
        default = row.cells[row.columns.index("default")] if "default" in row.columns else None
        yield keys, default


def data_rows(text: str) -> Dict[str, List[str]]:
    """``data`` kind -> the keys its row of the data table lists."""
    rows = {}
    for row in doc_rows(text, "option"):
        kind = _BACKTICKED.findall(row.cells[0])[0]
        parts, depth, current = [], 0, ""
        for char in row.cells[1]:  # commas inside a note (parentheses) do not separate keys
            depth += {"(": 1, ")": -1}.get(char, 0)
            if char == "," and depth == 0:
                parts.append(current)
                current = ""
            else:
                current += char
        rows[kind] = [_BACKTICKED.findall(part)[0] for part in parts + [current]]
    return rows


def stated_defaults(cell: str, count: int) -> List[Any]:
    """The values a default cell states for ``count`` keys (a trailing note in parentheses left out)."""
    plain = re.sub(r"\s*\([^()]*\)$", "", cell).replace("`", "")
    values = [plain] if count == 1 else [v.strip() for v in plain.split(",")]
    assert len(values) == count, f"default {cell!r} for {count} keys"
    return [yaml.safe_load(value) for value in values]


def schema_defaults() -> Dict[str, Any]:
    """Dotted key -> the schema's default (keys without a default, e.g. data paths, left out)."""
    return {key: value for key, value in leaves(dataclasses.asdict(TrainConfig())) if value != "???"}


def _same(stated: Any, default: Any) -> bool:
    return stated == default and isinstance(stated, bool) == isinstance(default, bool)


def _read_doc() -> str:
    with open(DOC, encoding="utf-8") as f:
        return f.read()


def test_every_schema_key_has_a_row_and_every_row_names_a_schema_key():
    text = _read_doc()
    rows = list(key_rows(text))
    documented = {key for keys, _ in rows for key in keys}
    data = data_rows(text)
    assert set(data) == set(DATA_KEYS), f"the data table's options {sorted(data)} are not the data kinds"
    documented |= {"data.kind"} | {f"data.{key}" for keys in data.values() for key in keys}
    for kind, keys in data.items():
        assert sorted(keys) == sorted(k for k in DATA_KEYS[kind] if k != "kind"), f"data={kind}'s row: {keys}"
    known = set(all_keys())
    assert documented <= known, f"rows naming no schema key: {sorted(documented - known)}"
    # A nested key (model.rope_scaling.factor) is its mapping's row's.
    missing = sorted(k for k in known if k not in documented and k.rsplit(".", 1)[0] not in documented)
    assert not missing, f"schema keys without a row in docs/recipes.md: {missing}"


def test_the_defaults_the_tables_state_are_the_schemas():
    defaults = schema_defaults()
    stated = 0
    for keys, cell in key_rows(_read_doc()):
        if cell is None:
            continue
        for key, value in zip(keys, stated_defaults(cell, len(keys))):
            assert key in defaults, f"docs/recipes.md states a default for {key}, which has none"
            assert _same(value, defaults[key]), \
                f"docs/recipes.md: {key} defaults to {cell}, the schema to {defaults[key]!r}"
            stated += 1
    assert stated >= 50  # the tables of training, logging, eval, profiling, model, optim, checkpoint
