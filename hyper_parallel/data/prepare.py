"""Pre-tokenize a corpus into the flat ``tokens`` format plus a JSON sidecar.

Documents stream from :func:`iter_documents` in chunks to worker processes; at most
``2 * workers`` chunks are in flight, so memory stays bounded whatever the corpus size. The
output is the documents' tokens joined by the tokenizer's separator (EOS), exactly the stream
``data=text`` builds in memory, so both give the same samples.
"""

from __future__ import annotations

import collections
import json
import os
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, BinaryIO, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from hyper_parallel.data.text import TEXT_SUFFIXES, expand_paths, iter_documents
from hyper_parallel.data.tokenizer import Tokenizer, load_tokenizer, token_dtype

SIDECAR_FORMAT = "hyper_parallel.tokens/1"

_worker_tokenizer: Optional[Tokenizer] = None


def sidecar_path(tokens_path: str) -> str:
    """The JSON description written next to a token file: ``<path>.json``."""
    return tokens_path + ".json"


def _init_worker(spec: str, eos_token: Optional[str]) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = load_tokenizer(spec, eos_token)


def _encode_chunk(texts: List[str]) -> List[np.ndarray]:
    return [_worker_tokenizer.encode(t) for t in texts]


def _chunks(documents: Iterator[str], docs_per_chunk: int) -> Iterator[List[str]]:
    chunk: List[str] = []
    for doc in documents:
        chunk.append(doc)
        if len(chunk) == docs_per_chunk:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encoded_chunks(paths: Sequence[str], spec: str, eos_token: Optional[str], workers: int,
                    docs_per_chunk: int) -> Iterator[tuple[List[str], List[np.ndarray]]]:
    """(texts, token arrays) per chunk, in corpus order, at most ``2 * workers`` chunks pending."""
    chunks = _chunks(iter_documents(paths), docs_per_chunk)
    if workers <= 1:
        _init_worker(spec, eos_token)
        for chunk in chunks:
            yield chunk, _encode_chunk(chunk)
        return
    with ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(spec, eos_token)) as pool:
        pending: Deque[tuple[List[str], Future]] = collections.deque()
        for chunk in chunks:
            pending.append((chunk, pool.submit(_encode_chunk, chunk)))
            if len(pending) >= 2 * workers:
                texts, future = pending.popleft()
                yield texts, future.result()
        while pending:
            texts, future = pending.popleft()
            yield texts, future.result()


def _check_output(paths: Sequence[str], output: str) -> None:
    """Refuse an output (or its sidecar) that is an input, or that a folder input would read.

    Raises:
        ValueError: naming the input.
    """
    if os.path.isdir(output):
        raise ValueError(f"the output {output} is a folder; name the token file to write")
    inputs = expand_paths(paths, TEXT_SUFFIXES)
    named = [os.path.expanduser(str(p)) for p in ([paths] if isinstance(paths, str) else paths)]
    folders = [os.path.realpath(p) for p in named if os.path.isdir(p)]
    for target in (output, sidecar_path(output)):
        real = os.path.realpath(target)
        for path in inputs:
            if os.path.realpath(path) == real or (os.path.exists(target) and os.path.samefile(path, target)):
                raise ValueError(f"the output {output} would overwrite the input {path}; choose another output")
        if target == output and real.endswith(TEXT_SUFFIXES):
            for folder in folders:
                if real.startswith(folder.rstrip(os.sep) + os.sep):
                    raise ValueError(f"the output {output} lies in the input folder {folder}, which is read for "
                                     f"{'/'.join(TEXT_SUFFIXES)} files; choose another output")


def _open_partial(path: str) -> Tuple[str, BinaryIO]:
    """A new ``<path>.partial`` for writing, never an existing file or a symlink's target.

    Raises:
        FileExistsError: it exists (another run is writing it, or one crashed).
    """
    partial = path + ".partial"
    try:
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        raise FileExistsError(f"{partial} exists: another prepare_data run is writing {path}, or one was "
                              f"interrupted; if none is running, delete it (rm {partial}) and run again") from None
    return partial, os.fdopen(fd, "wb")


def prepare_tokens(paths: Sequence[str], output: str, *, tokenizer: str = "bytes",
                   eos_token: Optional[str] = None, workers: int = 1, docs_per_chunk: int = 256,
                   progress: Optional[Callable[[int, int], None]] = None) -> Dict[str, Any]:
    """Tokenize the documents under ``paths`` into ``output`` and ``output.json``.

    Both are written to ``<name>.partial`` first (created exclusively, never through a symlink)
    and renamed into place at the end, so an interrupted run leaves the old files intact.

    Args:
        tokenizer: ``bytes`` or a local ``tokenizer.json``.
        workers: tokenizer processes (1: in this process).
        progress: called with (documents, bytes of text) after each chunk.

    Returns:
        The sidecar: ``format``, ``tokenizer``, ``vocab_size``, ``eos_id``, ``dtype``,
        ``num_tokens``, ``num_documents``.

    Raises:
        FileNotFoundError / ValueError: unreadable input, a bad tokenizer, an empty corpus, an
            output that is an input.
        FileExistsError: a ``.partial`` file of an interrupted run is in the way.
    """
    for name, value in (("workers", workers), ("docs_per_chunk", docs_per_chunk)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    _check_output(paths, output)
    tok = load_tokenizer(tokenizer, eos_token)  # fails here, before any worker starts
    dtype = token_dtype(tok.vocab_size)
    limit = np.iinfo(dtype).max
    separator = tok.separator.astype(dtype)
    num_tokens = num_docs = 0
    partial, out = _open_partial(output)
    try:
        with out:
            for texts, encoded in _encoded_chunks(paths, tokenizer, eos_token, workers, docs_per_chunk):
                for ids in encoded:
                    if ids.size and (ids.max() > limit or ids.min() < 0):
                        bad = int(ids.max() if ids.max() > limit else ids.min())
                        raise ValueError(f"document {num_docs + 1}: token id {bad} from {tok.name} does not fit "
                                         f"{dtype} (vocab_size={tok.vocab_size})")
                    if num_docs:
                        out.write(separator.tobytes())
                        num_tokens += len(separator)
                    out.write(ids.astype(dtype).tobytes())
                    num_tokens += len(ids)
                    num_docs += 1
                if progress is not None:
                    progress(len(texts), sum(len(t.encode("utf-8")) for t in texts))
        if num_tokens == 0:
            raise ValueError(f"the corpus {list(paths)} holds no text (0 tokens)")
        meta = {"format": SIDECAR_FORMAT, "tokenizer": tok.name, "vocab_size": tok.vocab_size,
                "eos_id": int(tok.separator[0]) if len(tok.separator) == 1 else None,
                "dtype": dtype, "num_tokens": num_tokens, "num_documents": num_docs}
        meta_partial, meta_out = _open_partial(sidecar_path(output))
    except BaseException:
        os.remove(partial)
        raise
    try:
        with meta_out:
            meta_out.write(json.dumps(meta, indent=2).encode())
    except BaseException:
        os.remove(partial)
        os.remove(meta_partial)
        raise
    os.replace(partial, output)
    os.replace(meta_partial, sidecar_path(output))
    return meta


# The sidecar's fields: (type, check, what the check asks).
_SIDECAR_FIELDS = {
    "tokenizer": (str, bool, "a tokenizer name"),
    "vocab_size": (int, lambda v: v > 0, "a positive integer"),
    "eos_id": ((int, type(None)), lambda v: v is None or v >= 0, "null or a non-negative integer"),
    "dtype": (str, lambda v: v in ("uint16", "uint32"), "uint16 or uint32"),
    "num_tokens": (int, lambda v: v >= 0, "a non-negative integer"),
    "num_documents": (int, lambda v: v >= 0, "a non-negative integer"),
}


def read_sidecar(tokens_path: str) -> Optional[Dict[str, Any]]:
    """The sidecar of a token file, or None if it has none.

    Raises:
        ValueError: the sidecar is not valid JSON of this format, or a field is missing or of
            the wrong type (naming the field and its value).
    """
    path = sidecar_path(tokens_path)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except (ValueError, RecursionError):
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != SIDECAR_FORMAT:
        raise ValueError(f"{path} is not a {SIDECAR_FORMAT} sidecar")
    for key, (kind, valid, wanted) in _SIDECAR_FIELDS.items():
        if key not in meta:
            raise ValueError(f"{path}: the sidecar has no {key!r} field; re-create it with scripts/prepare_data.py")
        value = meta[key]
        if isinstance(value, bool) or not isinstance(value, kind) or not valid(value):
            raise ValueError(f"{path}: the sidecar's {key!r} is {value!r}, not {wanted}; the sidecar is damaged: "
                             "re-create it with scripts/prepare_data.py")
    return meta
