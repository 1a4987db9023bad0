"""Token sources: synthetic Markov chain, local text corpora (tokenized on load), flat token files.

Every source answers ``samples(indices) -> LongTensor (len(indices), seq_len + 1)``: the
tokens of each global sample, the same whatever process or batch asks for it.
"""

from __future__ import annotations

import os
from typing import Optional, Protocol, Sequence

import numpy as np
import torch

from hyper_parallel.data.prepare import read_sidecar
from hyper_parallel.data.text import expand_paths, iter_documents
from hyper_parallel.data.tokenizer import Tokenizer, check_vocab, load_tokenizer

_TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
_SCAN_CHUNK = 1 << 24  # token ids read at once when validating a token array


class TokenSource(Protocol):
    """A deterministic map from global sample index to ``seq_len + 1`` tokens."""

    seq_len: int
    vocab_size: int
    # None: unbounded (every index is a fresh sample, no epochs).
    num_samples: Optional[int]
    # The one token that ends each document of packed samples (document masks); None: unknown.
    eos_id: Optional[int]

    def samples(self, indices: Sequence[int]) -> torch.Tensor: ...

    def validate(self, part: int, parts: int) -> None:
        """Check part ``part`` of ``parts`` of the data (each rank checks one) before training.

        Raises:
            ValueError: the data cannot feed the model (e.g. a token id >= vocab_size).
        """

    def loss_floor(self) -> Optional[float]:
        """The best achievable mean next-token loss (nats/token), or None where it is unknown."""


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
        self.eos_id: Optional[int] = None  # no documents
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

    def __init__(self, tokens: np.ndarray, seq_len: int, vocab_size: int, *, name: str = "tokens",
                 eos_id: Optional[int] = None):
        self.tokens, self.seq_len, self.vocab_size, self.name = tokens, seq_len, vocab_size, name
        self.eos_id = eos_id
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

    def loss_floor(self) -> Optional[float]:
        """Unknown for real text: None."""
        return None

    def samples(self, indices: Sequence[int]) -> torch.Tensor:
        rows = [np.asarray(self.tokens[i * self.seq_len : i * self.seq_len + self.seq_len + 1], dtype=np.int64)
                for i in indices]
        batch = torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, self.seq_len + 1, dtype=torch.long)
        if batch.numel() and int(batch.max()) >= self.vocab_size:
            raise ValueError(
                f"{self.name}: token id {int(batch.max())} is outside the model's vocab_size={self.vocab_size}"
            )
        return batch


def read_text_tokens(paths: str | Sequence[str], tokenizer: Tokenizer) -> np.ndarray:
    """Tokenize local documents (see :func:`iter_documents`) into one array, joined by the
    tokenizer's separator (EOS).

    Raises:
        ValueError: the corpus holds no text.
    """
    parts: list[np.ndarray] = []
    for text in iter_documents(paths):
        if parts:
            parts.append(tokenizer.separator)
        parts.append(tokenizer.encode(text))
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if not len(tokens):
        raise ValueError(f"the corpus {paths} holds no text (0 tokens)")
    return tokens


def split_windows(source: TokenWindows, val_fraction: float) -> tuple[TokenWindows, TokenWindows]:
    """The last ``val_fraction`` of the samples (at least one) held out as a validation source.

    Raises:
        ValueError: fewer than two samples, or ``val_fraction`` not in (0, 1).
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
    n = source.num_samples
    n_val = max(1, round(n * val_fraction))
    if n_val >= n:
        raise ValueError(f"{source.name}: {n} samples cannot be split into train and validation "
                         f"with val_fraction={val_fraction}")
    cut = (n - n_val) * source.seq_len
    return (TokenWindows(source.tokens[: cut + 1], source.seq_len, source.vocab_size, name=source.name,
                         eos_id=source.eos_id),
            TokenWindows(source.tokens[cut:], source.seq_len, source.vocab_size,
                         name=f"{source.name} (validation split: its tokens {cut:,} to the end)", eos_id=source.eos_id))


def read_token_file(path: str, dtype: str) -> np.ndarray:
    """Memory-map a flat binary file of ``uint16``/``uint32`` token ids (native byte order)."""
    if dtype not in _TOKEN_DTYPES:
        raise ValueError(f"token dtype {dtype!r} is not one of {sorted(_TOKEN_DTYPES)}")
    (path,) = expand_paths(path)
    itemsize = np.dtype(_TOKEN_DTYPES[dtype]).itemsize
    if os.path.getsize(path) % itemsize:
        raise ValueError(f"{path}: size {os.path.getsize(path)} is not a multiple of {dtype} ({itemsize} bytes)")
    return np.memmap(path, dtype=_TOKEN_DTYPES[dtype], mode="r")


def check_sidecar(path: str, dtype: str, vocab_size: int, tokenizer: Optional[str] = None) -> None:
    """Check a token file against its ``.json`` sidecar (written by ``scripts/prepare_data.py``).

    Raises:
        ValueError: the stored dtype, token count, vocabulary or tokenizer does not match.
    """
    meta = read_sidecar(path)
    if meta is None:
        return
    where = f"{path} (per its sidecar)"
    if meta["dtype"] != dtype:
        raise ValueError(f"{where} holds {meta['dtype']} ids, but data.dtype={dtype}")
    size = os.path.getsize(path)
    if size != meta["num_tokens"] * np.dtype(_TOKEN_DTYPES[dtype]).itemsize:
        raise ValueError(f"{where} should hold {meta['num_tokens']} tokens but has {size} bytes "
                         "(truncated or overwritten?)")
    if meta["vocab_size"] > vocab_size:
        raise ValueError(f"{where} was tokenized with vocab_size={meta['vocab_size']}, more than "
                         f"model.vocab_size={vocab_size}")
    if tokenizer not in (None, "bytes"):
        tokenizer = os.path.abspath(os.path.expanduser(tokenizer))
        if os.path.isdir(tokenizer):
            tokenizer = os.path.join(tokenizer, "tokenizer.json")
    if tokenizer is not None and tokenizer != meta["tokenizer"]:
        raise ValueError(f"{where} was tokenized with {meta['tokenizer']}, not data.tokenizer={tokenizer}")


def build_source(kind: str, *, seq_len: int, vocab_size: int, seed: int, **options) -> TokenSource:
    """Build a token source from the ``data`` config group.

    Args:
        kind: ``synthetic`` (options: ``branching``, ``concentration``, ``chain_seed``), ``text``
            (``paths``, ``tokenizer``, ``eos_token``) or ``tokens`` (``path``, ``dtype``,
            ``tokenizer``: checked against the file's sidecar when given).
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
        tokenizer = load_tokenizer(options.pop("tokenizer", "bytes"), options.pop("eos_token", None))
        check_vocab(tokenizer, vocab_size)
        tokens = read_text_tokens(options.pop("paths"), tokenizer)
        _reject_unknown(kind, options)
        eos_id = int(tokenizer.separator[0]) if len(tokenizer.separator) == 1 else None
        return TokenWindows(tokens, seq_len, vocab_size, name="text", eos_id=eos_id)
    if kind == "tokens":
        path, dtype = options.pop("path"), options.pop("dtype", "uint16")
        check_sidecar(path, dtype, vocab_size, options.pop("tokenizer", None))
        tokens = read_token_file(path, dtype)
        _reject_unknown(kind, options)
        sidecar = read_sidecar(path)
        return TokenWindows(tokens, seq_len, vocab_size, name=str(path),
                            eos_id=sidecar["eos_id"] if sidecar is not None else None)
    raise ValueError(f"unknown data kind {kind!r}; expected synthetic, text or tokens")


def _reject_unknown(kind: str, options: dict) -> None:
    if options:
        raise ValueError(f"data={kind}: unknown option(s) {sorted(options)}")
