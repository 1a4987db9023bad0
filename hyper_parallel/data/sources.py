"""Token sources: synthetic Markov chain, local text files (bytes), flat binary token files.

Every source answers ``samples(indices) -> LongTensor (len(indices), seq_len + 1)``: the
tokens of each global sample, the same whatever process or batch asks for it.
"""

from __future__ import annotations

import glob
import os
from typing import Optional, Protocol, Sequence

import numpy as np
import torch

_TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_SCAN_CHUNK = 1 << 24  # token ids read at once when validating a token array


class TokenSource(Protocol):
    """A deterministic map from global sample index to ``seq_len + 1`` tokens."""

    seq_len: int
    vocab_size: int
    # None: unbounded (every index is a fresh sample, no epochs).
    num_samples: Optional[int]

    def samples(self, indices: Sequence[int]) -> torch.Tensor: ...

    def validate(self, part: int, parts: int) -> None:
        """Check part ``part`` of ``parts`` of the data (each rank checks one) before training.

        Raises:
            ValueError: the data cannot feed the model (e.g. a token id >= vocab_size).
        """


class MarkovSource:
    """Sequences from a fixed, seeded, sparse first-order Markov chain over ``vocab_size`` tokens.

    Each token has ``branching`` possible successors with random probabilities (the chain is
    fixed by ``seed``); sample ``i`` is drawn with its own generator seeded by
    ``(sample_seed, i)`` (``sample_seed`` defaults to ``seed``). Because the chain and the start
    distribution (uniform) are known, the best achievable mean next-token loss is exact:
    see :meth:`loss_floor`.
    """

    def __init__(self, vocab_size: int, seq_len: int, *, seed: int = 0, sample_seed: Optional[int] = None,
                 branching: int = 4, concentration: float = 0.5):
        if not 1 <= branching <= vocab_size:
            raise ValueError(f"branching={branching} must be in [1, vocab_size={vocab_size}]")
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.sample_seed = seed if sample_seed is None else sample_seed
        self.num_samples: Optional[int] = None
        chain_rng = np.random.default_rng([seed, 0x6D61726B])  # the chain itself, not the samples
        self.successors = np.stack(
            [chain_rng.choice(vocab_size, size=branching, replace=False) for _ in range(vocab_size)]
        )
        self.probs = chain_rng.dirichlet(np.full(branching, concentration), size=vocab_size)
        self._cdf = np.cumsum(self.probs, axis=1)
        self._cdf[:, -1] = 1.0

    def samples(self, indices: Sequence[int]) -> torch.Tensor:
        n = len(indices)
        uniforms = np.stack(
            [np.random.default_rng([self.sample_seed, int(i)]).random(self.seq_len + 1) for i in indices]
        ) if n else np.zeros((0, self.seq_len + 1))
        tokens = np.empty((n, self.seq_len + 1), dtype=np.int64)
        tokens[:, 0] = np.minimum((uniforms[:, 0] * self.vocab_size).astype(np.int64), self.vocab_size - 1)
        for t in range(1, self.seq_len + 1):
            current = tokens[:, t - 1]
            choice = (self._cdf[current] < uniforms[:, t : t + 1]).sum(axis=1)
            tokens[:, t] = self.successors[current, np.minimum(choice, self.successors.shape[1] - 1)]
        return torch.from_numpy(tokens)

    @staticmethod
    def memory_bytes(vocab_size: int, branching: int) -> int:
        """Bytes of the chain's tables (successors, probabilities, their running sums)."""
        return 3 * 8 * vocab_size * branching

    def validate(self, part: int, parts: int) -> None:
        """Nothing to check: every token of the chain is below ``vocab_size`` by construction."""

    def loss_floor(self) -> float:
        """Exact expected cross-entropy (nats/token) of the Bayes-optimal next-token predictor.

        Target ``t+1`` depends only on token ``t``; its best loss is the entropy of that token's
        transition row, averaged over the marginal of token ``t`` (uniform at ``t=0``, then
        pushed through the sparse chain: O(vocab_size x branching) memory and time per step).
        """
        with np.errstate(divide="ignore", invalid="ignore"):
            row_entropy = -np.nansum(np.where(self.probs > 0, self.probs * np.log(self.probs), 0.0), axis=1)
        successors = self.successors.ravel()
        marginal = np.full(self.vocab_size, 1.0 / self.vocab_size)
        total = 0.0
        for _ in range(self.seq_len):
            total += float(marginal @ row_entropy)
            marginal = np.bincount(successors, weights=(marginal[:, None] * self.probs).ravel(),
                                   minlength=self.vocab_size)
        return total / self.seq_len


class TokenWindows:
    """Non-overlapping ``seq_len + 1`` windows (sharing their boundary token) over a flat token array."""

    def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: int, *, name: str = "tokens"):
        self.tokens, self.seq_len, self.vocab_size, self.name = tokens, seq_len, vocab_size, name
        self.num_samples = (len(tokens) - 1) // seq_len
        if self.num_samples < 1:
            raise ValueError(
                f"{name}: {len(tokens)} tokens are fewer than one sample of seq_len + 1 = {seq_len + 1}"
            )

    def validate(self, part: int, parts: int) -> None:
        """Every token id in part ``part`` of ``parts`` of the array is below ``vocab_size``.

        Raises:
            ValueError: naming the first id out of range and its position.
        """
        n = len(self.tokens)
        end = n * (part + 1) // parts
        for start in range(n * part // parts, end, _SCAN_CHUNK):
            chunk = np.asarray(self.tokens[start:min(start + _SCAN_CHUNK, end)])
            bad = np.flatnonzero(chunk >= self.vocab_size)
            if bad.size:
                i = start + int(bad[0])
                raise ValueError(f"{self.name}: token id {int(chunk[bad[0]])} is outside the model's "
                                 f"vocab_size={self.vocab_size} (token {i:,} of {n:,})")

    def samples(self, indices: Sequence[int]) -> torch.Tensor:
        rows = [np.asarray(self.tokens[i * self.seq_len : i * self.seq_len + self.seq_len + 1], dtype=np.int64)
                for i in indices]
        batch = torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, self.seq_len + 1, dtype=torch.long)
        if batch.numel() and int(batch.max()) >= self.vocab_size:
            raise ValueError(
                f"{self.name}: token id {int(batch.max())} is outside the model's vocab_size={self.vocab_size}"
            )
        return batch


class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary of 256); documents are joined by ``separator``."""

    vocab_size = 256

    def __init__(self, separator: bytes = b"\n\n"):
        self.separator = separator

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def _expand_paths(paths: str | Sequence[str]) -> list[str]:
    patterns = [paths] if isinstance(paths, str) else list(paths)
    found: list[str] = []
    for pattern in patterns:
        pattern = os.path.expanduser(str(pattern))
        found.extend(sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern)
                     else [pattern])
    missing = [p for p in found if not os.path.isfile(p)]
    if not found or missing:
        raise FileNotFoundError(f"no such data file(s): {missing or patterns}")
    return found


def read_text_tokens(paths: str | Sequence[str], tokenizer: ByteTokenizer) -> np.ndarray:
    """Read local text files (paths or glob patterns, in sorted order) into one byte-token array."""
    separator = np.frombuffer(tokenizer.separator, dtype=np.uint8)
    parts = []
    for path in _expand_paths(paths):
        with open(path, "rb") as f:
            parts.extend([np.frombuffer(f.read(), dtype=np.uint8), separator])
    return np.concatenate(parts[:-1])


def read_token_file(path: str, dtype: str) -> np.ndarray:
    """Memory-map a flat binary file of ``uint16``/``uint32`` token ids (native byte order)."""
    if dtype not in _TOKEN_DTYPES:
        raise ValueError(f"token dtype {dtype!r} is not one of {sorted(_TOKEN_DTYPES)}")
    (path,) = _expand_paths(path)
    itemsize = np.dtype(_TOKEN_DTYPES[dtype]).itemsize
    if os.path.getsize(path) % itemsize:
        raise ValueError(f"{path}: size {os.path.getsize(path)} is not a multiple of {dtype} ({itemsize} bytes)")
    return np.memmap(path, dtype=_TOKEN_DTYPES[dtype], mode="r")


def build_source(kind: str, *, seq_len: int, vocab_size: int, seed: int, **options) -> TokenSource:
    """Build a token source from the ``data`` config group.

    Args:
        kind: ``synthetic`` (options: ``branching``, ``concentration``, ``chain_seed``), ``text``
            (``paths``) or ``tokens`` (``path``, ``dtype``).
        seq_len: tokens per sample fed to the model (each sample holds ``seq_len + 1``).
        vocab_size: the model's vocabulary; token ids must be below it.
        seed: seeds the synthetic samples (and the chain, unless ``chain_seed`` is given).

    Raises:
        ValueError: unknown kind or options, or data that does not fit the model.
        FileNotFoundError: a named file does not exist.
    """
    if kind == "synthetic":
        chain_seed = options.pop("chain_seed", seed)
        return MarkovSource(vocab_size, seq_len, seed=chain_seed, sample_seed=seed, **options)
    if kind == "text":
        tokenizer = ByteTokenizer()
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(f"data=text needs a model vocab_size >= 256 (byte tokens), got {vocab_size}")
        tokens = read_text_tokens(options.pop("paths"), tokenizer)
        _reject_unknown(kind, options)
        return TokenWindows(tokens, seq_len, vocab_size, name="text")
    if kind == "tokens":
        path = options.pop("path")
        tokens = read_token_file(path, options.pop("dtype", "uint16"))
        _reject_unknown(kind, options)
        return TokenWindows(tokens, seq_len, vocab_size, name=str(path))
    raise ValueError(f"unknown data kind {kind!r}; expected synthetic, text or tokens")


def _reject_unknown(kind: str, options: dict) -> None:
    if options:
        raise ValueError(f"data={kind}: unknown option(s) {sorted(options)}")
