"""Documents from local corpora: ``.txt`` (a file is a document), ``.jsonl`` (a ``text`` field
per line) and ``.parquet`` (a ``text`` column, read in record batches), as files, folders or
glob patterns. Everything streams: one record batch or line at a time."""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator, Sequence

from hyper_parallel._optional import require

TEXT_SUFFIXES = (".txt", ".jsonl", ".parquet")
TEXT_FIELD = "text"


def expand_paths(paths: str | Sequence[str], suffixes: Sequence[str] | None = None) -> list[str]:
    """Files named by ``paths`` (files, glob patterns, folders searched recursively for
    ``suffixes``), each pattern's matches in sorted order.

    Raises:
        FileNotFoundError: nothing found, or a named file does not exist.
    """
    patterns = [paths] if isinstance(paths, str) else list(paths)
    found: list[str] = []
    for pattern in patterns:
        pattern = os.path.expanduser(str(pattern))
        if os.path.isdir(pattern) and suffixes:
            found.extend(sorted(os.path.join(root, name) for root, _, names in os.walk(pattern)
                                for name in names if name.endswith(tuple(suffixes))))
        elif glob.has_magic(pattern):
            found.extend(sorted(glob.glob(pattern, recursive=True)))
        else:
            found.append(pattern)
    missing = [p for p in found if not os.path.isfile(p)]
    if not found or missing:
        raise FileNotFoundError(f"no such data file(s): {missing or patterns}")
    return found


def _utf8(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not UTF-8 text ({err.reason} at byte {err.start})") from None


def _jsonl_documents(path: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line = _utf8(raw, f"{path}:{number}")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                text = record[TEXT_FIELD]
            except RecursionError:
                raise ValueError(f"{path}:{number}: JSON nested too deeply to read") from None
            except (ValueError, KeyError, TypeError, IndexError):
                raise ValueError(f"{path}:{number}: not a JSON object with a {TEXT_FIELD!r} field") from None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{number}: the {TEXT_FIELD!r} field is a {type(text).__name__}, "
                                 "not a string")
            yield text


def _is_text_type(pa, kind) -> bool:
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or str(kind) == "string_view"


def _parquet_documents(path: str, batch_rows: int = 1024) -> Iterator[str]:
    pa = require("pyarrow", f"reading {path}")
    pq = require("pyarrow.parquet", f"reading {path}")
    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises its own ArrowInvalid / OSError types
        raise ValueError(f"{path}: not a parquet file ({err})") from None
    schema = table.schema_arrow
    if TEXT_FIELD not in schema.names:
        raise ValueError(f"{path}: no {TEXT_FIELD!r} column (columns: {schema.names})")
    kind = schema.field(TEXT_FIELD).type
    if not _is_text_type(pa, kind):
        raise ValueError(f"{path}: the {TEXT_FIELD!r} column holds {kind}, not strings")
    row = 0
    batches = table.iter_batches(batch_size=batch_rows, columns=[TEXT_FIELD])
    while True:
        try:
            column = next(batches).column(0)
        except StopIteration:
            return
        except pa.ArrowException as err:
            raise ValueError(f"{path}: unreadable after row {row} ({str(err).splitlines()[0]})") from None
        try:
            texts = column.to_pylist()
        except UnicodeDecodeError as err:
            bad = next(i for i in range(len(column)) if not _decodes(column[i]))
            raise ValueError(f"{path}: row {row + bad + 1}: not UTF-8 text ({err.reason})") from None
        yield from (text for text in texts if text is not None)
        row += len(column)


def _decodes(value) -> bool:
    try:
        value.as_py()
    except UnicodeDecodeError:
        return False
    return True


def iter_documents(paths: str | Sequence[str]) -> Iterator[str]:
    """Every document of the corpus, in file order (sorted within each pattern or folder).

    Raises:
        FileNotFoundError: no files found.
        ValueError: a jsonl line without a string ``text`` (or nested too deeply), a parquet
            file without a string ``text`` column, text that is not UTF-8 (naming file and line).
        MissingDependency: a parquet file without pyarrow installed.
    """
    for path in expand_paths(paths, TEXT_SUFFIXES):
        if path.endswith(".jsonl"):
            yield from _jsonl_documents(path)
        elif path.endswith(".parquet"):
            yield from _parquet_documents(path)
        else:  # .txt, or any other file named explicitly: one UTF-8 document
            with open(path, "rb") as f:
                raw = f.read()
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as err:
                line = raw.count(b"\n", 0, err.start) + 1
                raise ValueError(f"{path}:{line}: not UTF-8 text ({err.reason} at byte {err.start})") from None
