"""Documents from local corpora: ``.txt`` (a file is a document), ``.jsonl`` (a ``text`` field
per line) and ``.parquet`` (a ``text`` column, read in record batches), as files, folders or
glob patterns. Everything streams: one record batch or line at a time."""

from __future__ import annotations

import glob
import json
import os
from typing import Iterator, Sequence

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


def _jsonl_documents(path: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                text = record[TEXT_FIELD]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{number}: not a JSON object with a {TEXT_FIELD!r} field") from None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{number}: the {TEXT_FIELD!r} field is not a string")
            yield text


def _parquet_documents(path: str, batch_rows: int = 1024) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises its own ArrowInvalid / OSError types
        raise ValueError(f"{path}: not a parquet file ({err})") from None
    if TEXT_FIELD not in table.schema_arrow.names:
        raise ValueError(f"{path}: no {TEXT_FIELD!r} column (columns: {table.schema_arrow.names})")
    for batch in table.iter_batches(batch_size=batch_rows, columns=[TEXT_FIELD]):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


def iter_documents(paths: str | Sequence[str]) -> Iterator[str]:
    """Every document of the corpus, in file order (sorted within each pattern or folder).

    Raises:
        FileNotFoundError: no files found.
        ValueError: a jsonl line without ``text``, a parquet file without a ``text`` column,
            a text file that is not UTF-8.
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
                raise ValueError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
