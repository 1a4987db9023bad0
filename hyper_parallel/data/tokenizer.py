"""Tokenizers for the text pipeline: UTF-8 bytes, or a local Hugging Face ``tokenizer.json``."""

from __future__ import annotations

import os
from typing import Protocol, Sequence

import numpy as np

BYTES = "bytes"
# End-of-document tokens looked up, in this order, when ``eos_token`` is not given.
_EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")


class Tokenizer(Protocol):
    """Text -> token ids, with the ids that join two documents."""

    name: str
    vocab_size: int
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

    Documents are joined by ``eos_token`` (default: the first of ``<|endoftext|>``,
    ``<|end_of_text|>``, ``</s>``, ``<eos>``, ``<|eos|>``, ``[SEP]`` the vocabulary holds).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a tokenizer, or it has no end-of-document token.
    """

    def __init__(self, path: str, eos_token: str | None = None):
        from tokenizers import Tokenizer as _Tokenizer

        path = os.path.expanduser(path)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file {path} does not exist")
        try:
            self._tok = _Tokenizer.from_file(path)
        except Exception as err:  # the Rust library raises a bare Exception
            raise ValueError(f"{path} is not a tokenizers tokenizer.json: {str(err).splitlines()[0]}") from None
        self.name = os.path.abspath(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        candidates = (eos_token,) if eos_token else _EOS_CANDIDATES
        ids = [self._tok.token_to_id(t) for t in candidates]
        found = [i for i in ids if i is not None]
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
        raise ValueError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} tokens, more than "
                         f"model.vocab_size={model_vocab_size}; raise model.vocab_size")


def token_dtype(vocab_size: int) -> str:
    """The smallest stored dtype for ids below ``vocab_size``: ``uint16`` or ``uint32``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"
