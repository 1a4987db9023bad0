"""The ``data`` group's schema: one dataclass per ``data.kind`` (``DATA_KINDS``). A new kind is one
:class:`DataConfig` subclass here plus its ``configs/data/<kind>.yaml``."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, List, Optional, Tuple, Type, Union

from hyper_parallel.trainer.config.rules import key

SEED_MAX = 2**32 - 1  # numpy's and the loader's seed range


@dataclass
class DataConfig:
    """Base of the ``data`` group's schemas: one subclass per ``data.kind`` (``DATA_KINDS``)."""

    kind: str = ""

    def shuffles(self) -> bool:
        """Whether the loader shuffles samples each epoch."""
        return False

    def held_out(self) -> Tuple[float, Optional[str]]:
        """``(val_fraction, val_path)`` of a corpus: the share of its last samples held out for
        evaluation, or a separate validation corpus."""
        return 0.0, None


@dataclass
class SyntheticDataConfig(DataConfig):
    """Seeded sparse Markov chain over the model's vocabulary; the best achievable loss is exact."""

    kind: str = "synthetic"
    chain_seed: int = key(1234, min=0, max=SEED_MAX)  # the chain itself (fixed across runs); samples follow training.seed
    branching: int = key(4, min=1)                     # successors per token
    concentration: float = key(0.5, min=0, min_open=True)  # Dirichlet concentration of the transition probabilities


class _Corpus:
    """What a corpus kind answers from its ``shuffle``, ``val_fraction`` and ``val_path`` keys."""

    shuffle: bool
    val_fraction: float
    val_path: Optional[str]

    def shuffles(self) -> bool:
        return self.shuffle

    def held_out(self) -> Tuple[float, Optional[str]]:
        return self.val_fraction, self.val_path


@dataclass
class TextDataConfig(_Corpus, DataConfig):
    """Local text corpora: .txt (a file is a document), .jsonl (a "text" field per line), .parquet
    (a "text" column); files, folders or glob patterns, joined by the tokenizer's EOS."""

    kind: str = "text"
    paths: Union[str, List[str]] = key(path=True)          # a file, folder, glob pattern, or a list of them
    tokenizer: str = key("bytes", path=True)               # bytes (UTF-8 bytes, vocabulary 256) | a tokenizer.json
    eos_token: Optional[str] = key(None)                   # the token joining documents (null: the tokenizer's)
    shuffle: bool = key(True)                              # shuffle samples each epoch (seeded by training.seed)
    val_fraction: float = key(0.0, min=0, max=1, max_open=True)  # hold out the corpus's last samples for eval
    val_path: Optional[str] = key(None, path=True)         # or a separate validation corpus


@dataclass
class TokensDataConfig(_Corpus, DataConfig):
    """A flat binary file of token ids, read by memory map, with a ``<path>.json`` sidecar
    (scripts/prepare_data.py writes both) checked against these settings and the model."""

    kind: str = "tokens"
    path: str = key(path=True)
    dtype: str = key("uint16", choices=("uint16", "uint32"))  # native byte order
    tokenizer: Optional[str] = key(None, path=True)        # if set, must be the tokenizer the sidecar names
    shuffle: bool = key(True)
    val_fraction: float = key(0.0, min=0, max=1, max_open=True)  # hold out the file's last samples for eval
    val_path: Optional[str] = key(None, path=True)         # or a separate token file


DATA_KINDS: Dict[str, Type[DataConfig]] = {
    "synthetic": SyntheticDataConfig, "text": TextDataConfig, "tokens": TokensDataConfig}
# data.<key> names of each kind (``kind`` itself included).
DATA_KEYS: Dict[str, Tuple[str, ...]] = {kind: tuple(f.name for f in fields(cls)) for kind, cls in DATA_KINDS.items()}
