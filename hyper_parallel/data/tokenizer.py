"""Tokenizers for the text pipeline: UTF-8 bytes, or a local Hugging Face ``tokenizer.json``."""

from __future__ import annotations

import os
from typing import Protocol, Sequence

import numpy as np

from hyper_parallel._optional import require

BYTES = "bytes"
# End-of-document tokens looked up, in this order, when ``eos_token`` is not given.
_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


class Tokenizer(Protocol):
    """Text -> token ids, with the ids that join two documents."""

    name: str
    vocab_size: int  # every id is below it: the largest id + 1
    separator: np.ndarray  # token ids placed between documents (the EOS token)

    def encode(self, text: str) -> np.ndarray: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary of 256); documents are joined by a blank line."""

    name = BYTES
    vocab_size = 256

    def __init__(self, separator: bytes = b"\n\n"):
        self.separator = np.frombuffer(separator, dtype=np.uint8).astype(np.int64)

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local ``tokenizer.json`` read by the ``tokenizers`` package (no download, no network).

    ``vocab_size`` is the largest id + 1 (added tokens included), which is more than the number
    of entries when the ids have gaps. Documents are joined by ``eos_token`` (default: the first of ``<|endoftext|>``,
    ``<|end_of_text|>``, ``</s>``, ``<eos>``, ``<|eos|>``, ``[SEP]`` the vocabulary holds).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a tokenizer, or it has no end-of-document token.
    """

    def __init__(self, path: str, eos_token: str | None = None):
        tokenizers = require("tokenizers", "a tokenizer.json tokenizer")
        path = os.path.expanduser(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file {path} does not exist")
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as err:  # the Rust library raises a bare Exception
            raise ValueError(f"{path} is not a tokenizers tokenizer.json: {str(err).splitlines()[0]}") from None
        self.name = os.path.abspath(path)
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        if not ids:
            raise ValueError(f"{path}: the tokenizer has no tokens")
        self.vocab_size = max(ids) + 1
        candidates = (eos_token,) if eos_token else _EOS_CANDIDATES
        found = [i for i in map(self._tok.token_to_id, candidates) if i is not None]
        if not found:
            raise ValueError(f"{path}: no end-of-document token among {list(candidates)}"
                             " (set data.eos_token to one of its tokens)")
        self.eos_id = found[0]
        self.separator = np.array([self.eos_id], dtype=np.int64)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.int64)
                for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, tokens: Sequence[int]) -> str:
        return self._tok.decode([int(t) for t in tokens])


def load_tokenizer(spec: str, eos_token: str | None = None) -> Tokenizer:
    """``bytes`` or the path of a local ``tokenizer.json`` (or a folder holding one)."""
    return ByteTokenizer() if spec == BYTES else HFTokenizer(spec, eos_token)


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Raises ValueError when the tokenizer's ids do not all fit the model's embedding."""
    if tokenizer.vocab_size > model_vocab_size:
        raise ValueError(f"tokenizer {tokenizer.name} has ids up to {tokenizer.vocab_size - 1}, which need "
                         f"vocab_size={tokenizer.vocab_size}, more than model.vocab_size={model_vocab_size}; "
                         "raise model.vocab_size")


def token_dtype(vocab_size: int) -> str:
    """The smallest stored dtype for ids below ``vocab_size`` (the largest id + 1): ``uint16``
    or ``uint32``.

    Raises:
        ValueError: ids that do not fit uint32.
    """
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise ValueError(f"token ids up to {vocab_size - 1} do not fit uint32")
