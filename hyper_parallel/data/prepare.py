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
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence

import numpy as np

from hyper_parallel.data.text import iter_documents
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


def prepare_tokens(paths: Sequence[str], output: str, *, tokenizer: str = "bytes",
                   eos_token: Optional[str] = None, workers: int = 1, docs_per_chunk: int = 256,
                   progress: Optional[Callable[[int, int], None]] = None) -> Dict[str, Any]:
    """Tokenize the documents under ``paths`` into ``output`` and ``output.json``.

    Args:
        tokenizer: ``bytes`` or a local ``tokenizer.json``.
        workers: tokenizer processes (1: in this process).
        progress: called with (documents, bytes of text) after each chunk.

    Returns:
        The sidecar: ``format``, ``tokenizer``, ``vocab_size``, ``eos_id``, ``dtype``,
        ``num_tokens``, ``num_documents``.

    Raises:
        FileNotFoundError / ValueError: unreadable input, a bad tokenizer, an empty corpus.
    """
    tok = load_tokenizer(tokenizer, eos_token)  # fails here, before any worker starts
    dtype = token_dtype(tok.vocab_size)
    separator = tok.separator.astype(dtype)
    num_tokens = num_docs = 0
    partial = output + ".partial"
    with open(partial, "wb") as out:
        for texts, encoded in _encoded_chunks(paths, tokenizer, eos_token, workers, docs_per_chunk):
            for ids in encoded:
                if num_docs:
                    out.write(separator.tobytes())
                    num_tokens += len(separator)
                out.write(ids.astype(dtype).tobytes())
                num_tokens += len(ids)
                num_docs += 1
            if progress is not None:
                progress(len(texts), sum(len(t.encode("utf-8")) for t in texts))
    if num_tokens == 0:
        os.remove(partial)
        raise ValueError(f"the corpus {list(paths)} holds no text (0 tokens)")
    os.replace(partial, output)
    meta = {"format": SIDECAR_FORMAT, "tokenizer": tok.name, "vocab_size": tok.vocab_size,
            "eos_id": int(tok.separator[0]) if len(tok.separator) == 1 else None,
            "dtype": dtype, "num_tokens": num_tokens, "num_documents": num_docs}
    with open(sidecar_path(output), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def read_sidecar(tokens_path: str) -> Optional[Dict[str, Any]]:
    """The sidecar of a token file, or None if it has none.

    Raises:
        ValueError: the sidecar is not valid JSON of this format.
    """
    path = sidecar_path(tokens_path)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            meta = json.load(f)
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or meta.get("format") != SIDECAR_FORMAT:
        raise ValueError(f"{path} is not a {SIDECAR_FORMAT} sidecar")
    return meta
