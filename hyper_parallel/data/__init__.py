"""Token sources and the stateful, rank-aware batch loader used by the recipes.

A *source* maps a global sample index to ``seq_len + 1`` token ids. The loader fixes the data
order on the global batch (independent of the number of ranks); each data-parallel rank takes
its slice of every global batch, and the loader's position is checkpointable.
"""

from hyper_parallel.data.loader import DistributedBatchLoader
from hyper_parallel.data.sources import (
    ByteTokenizer,
    MarkovSource,
    TokenSource,
    TokenWindows,
    build_source,
    read_text_tokens,
    read_token_file,
)

__all__ = [
    "ByteTokenizer",
    "DistributedBatchLoader",
    "MarkovSource",
    "TokenSource",
    "TokenWindows",
    "build_source",
    "read_text_tokens",
    "read_token_file",
]
