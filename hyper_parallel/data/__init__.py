"""Token sources and the stateful, rank-aware batch loader used by the recipes.

A *source* maps a global sample index to ``seq_len + 1`` token ids. The loader fixes the data
order on the global batch (independent of the number of ranks); each data-parallel rank takes
its slice of every global batch, and the loader's position is checkpointable.

May import ``_optional`` (tokenizers, pyarrow) and ``utils``; never ``core``, ``models``,
``parallel`` or ``trainer``.
"""

from hyper_parallel.data.loader import DistributedBatchLoader
from hyper_parallel.data.prepare import prepare_tokens, read_sidecar
from hyper_parallel.data.sources import (
    MarkovSource,
    TokenSource,
    TokenWindows,
    build_source,
    read_text_tokens,
    read_token_file,
    split_windows,
)
from hyper_parallel.data.text import iter_documents
from hyper_parallel.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "DistributedBatchLoader",
    "MarkovSource",
    "TokenSource",
    "TokenWindows",
    "HFTokenizer",
    "Tokenizer",
    "build_source",
    "iter_documents",
    "load_tokenizer",
    "prepare_tokens",
    "read_sidecar",
    "split_windows",
    "read_text_tokens",
    "read_token_file",
]
