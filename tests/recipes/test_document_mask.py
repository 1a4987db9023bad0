"""``training.document_mask``: packed documents attend only within themselves, in the recipe.

Each EOS token of the data ends a document; every micro-batch's attention (training and
evaluation) then masks the other documents out. Attention under the masks equals attention run
on each document alone (``tests/test_ring_attention.py``, float64); here the recipe trains the
same curve with them on one process and under CP2 (ring attention with the masks), and another
curve without them. Float64, as ``test_cp_recipe.py`` (CP reorders sums: ~1e-16 noise).
"""

from __future__ import annotations

import json
import random
from typing import List

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.platform import get_platform
from hyper_parallel.trainer import compose_config, run_training, validate_config
from tests.multirank import run_on_ranks
from tests.recipes.corpus import MODEL_VOCAB, WORDS, train_tokenizer
from tests.recipes.launch import TINY, last_loss_per_step, read_metrics
from tests.recipes.train_in_process import one_line_error

REL = 1e-9
STEPS = ["training.steps=3", "training.seq_len=16", "eval.every=3", "eval.steps=1", f"model.vocab_size={MODEL_VOCAB}",
         "data=text", "data.val_fraction=0.2", "checkpoint.interval=3"]


def _train_float64(overrides: List[str]) -> None:
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        run_training(validate_config(compose_config([*TINY, *STEPS, *overrides]), dist.get_world_size()),
                     get_platform())
    finally:
        torch.set_default_dtype(default)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> List[str]:
    """``data.paths`` and ``data.tokenizer`` of 120 short documents (3 to 8 words: a 16-token
    sample holds several)."""
    root = tmp_path_factory.mktemp("documents")
    rng = random.Random(7)
    docs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))) for _ in range(120)]
    with open(root / "docs.jsonl", "w") as f:
        f.writelines(json.dumps({"text": doc}) + "\n" for doc in docs)
    return [f"data.paths={root / 'docs.jsonl'}", f"data.tokenizer={train_tokenizer(docs, str(root / 'tokenizer.json'))}"]


def _curve(output_dir) -> dict:
    return {"loss": last_loss_per_step(str(output_dir)),
            "val_loss": {r["step"]: r["val_loss"] for r in read_metrics(str(output_dir)) if "val_loss" in r}}


def test_document_masks_train_the_same_curve_on_one_process_and_under_cp2(corpus, tmp_path):
    """With masks: one process and CP2 (documents across the two ranks' chunks) give the same
    losses and validation loss; without masks the curve differs (the masks are applied)."""
    runs = {"masked": (1, ["training.document_mask=true"]),
            "masked_cp2": (2, ["training.document_mask=true", "parallel.cp=2"]),
            "unmasked": (1, [])}
    for name, (world, overrides) in runs.items():
        run_on_ranks(world, _train_float64, [f"output_dir={tmp_path / name}", *corpus, *overrides], timeout=180)
    expected = _curve(tmp_path / "masked")
    assert len(expected["loss"]) == 3 and list(expected["val_loss"]) == [3], expected
    for key, values in _curve(tmp_path / "masked_cp2").items():
        assert sorted(values) == sorted(expected[key])
        for step, value in values.items():
            assert abs(value - expected[key][step]) <= REL * abs(expected[key][step]), (key, step, value)
    unmasked = _curve(tmp_path / "unmasked")
    # At initialisation attention is near uniform: the masks move the first loss by ~1e-4, far above noise.
    assert abs(unmasked["loss"][1] - expected["loss"][1]) > 1e-5 * expected["loss"][1], (unmasked, expected)


@pytest.mark.parametrize("overrides, expected", [
    ([], "training.document_mask=true needs documents: data=synthetic has none"),
    (["data=text", "data.paths=docs.jsonl", "parallel.pp=2"],
     "training.document_mask=true with parallel.pp=2 is not supported yet"),
])
def test_document_masks_without_documents_or_with_pipelines_are_refused(check, overrides, expected):
    one_line_error(*check(*TINY, "training.document_mask=true", *overrides)[::2], expected)


def test_document_masks_need_a_one_token_end_of_document(check, corpus):
    """The bytes tokenizer joins documents with two tokens (a blank line): refused before start."""
    one_line_error(*check(*TINY, *STEPS, corpus[0], "data.tokenizer=bytes", "model.vocab_size=256",
                          "training.document_mask=true")[::2],
                   "training.document_mask=true needs documents that each end with one token: data=text has none")
