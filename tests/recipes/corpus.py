"""A tiny corpus in every supported format and a BPE tokenizer trained on it (no downloads)."""

from __future__ import annotations

import json
import os
import random
from typing import List

WORDS = ("the quick brown fox jumps over lazy dog data parallel shard gradient loss step model token "
         "checkpoint resume mesh").split()
VOCAB = 300  # the BPE tokenizer's size; models use MODEL_VOCAB >= it
MODEL_VOCAB = 320


def documents(n: int = 36, seed: int = 0) -> List[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 50))) + "." for _ in range(n)]


def train_tokenizer(docs: List[str], path: str) -> str:
    """A byte-level BPE ``tokenizer.json`` with ``<|endoftext|>``, trained on ``docs``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    tok.save(path)
    return path


def write_corpus(docs: List[str], folder: str) -> List[str]:
    """``docs`` split over a .txt file (one document), a .jsonl file and a .parquet file, in a
    folder whose sorted listing gives back the documents in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(folder, exist_ok=True)
    third = len(docs) // 3
    with open(os.path.join(folder, "a.txt"), "w") as f:
        f.write(docs[0])
    with open(os.path.join(folder, "b.jsonl"), "w") as f:
        for doc in docs[1:third]:
            f.write(json.dumps({"text": doc, "id": 1}) + "\n")
    pq.write_table(pa.table({"text": docs[third:], "n": list(range(len(docs) - third))}),
                   os.path.join(folder, "c.parquet"), row_group_size=5)
    return docs


def make_corpus(root: str) -> tuple[List[str], str, str]:
    """``(documents, tokenizer.json path, corpus folder)`` under ``root``."""
    docs = documents()
    tokenizer = train_tokenizer(docs, os.path.join(root, "tokenizer.json"))
    write_corpus(docs, os.path.join(root, "text"))
    return docs, tokenizer, os.path.join(root, "text")
