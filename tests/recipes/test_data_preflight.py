"""The data against the config before any rank starts (``recipes/train.py --check``), and the
validation data checked before the first evaluation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hyper_parallel.data import TokenWindows, prepare_tokens
from hyper_parallel.trainer.step.evaluation import Evaluator
from tests.recipes.train_in_process import one_line_error


@pytest.fixture
def token_file(tmp_path):
    """100,000 byte tokens (uint16, vocabulary 256) with their sidecar."""
    (tmp_path / "c.txt").write_text("the quick brown fox " * 5_000)
    out = str(tmp_path / "tokens.bin")
    prepare_tokens([str(tmp_path / "c.txt")], out)
    return out


@pytest.mark.parametrize("override,expected", [
    ("data.dtype=uint32", "holds uint16 ids, but data.dtype=uint32"),
    ("model.vocab_size=200", "was tokenized with vocab_size=256, more than model.vocab_size=200"),
    ("data.tokenizer=bytes", None),
    ("data.tokenizer=/elsewhere/tokenizer.json", "was tokenized with bytes, not data.tokenizer=/elsewhere"),
])
def test_check_compares_the_token_file_with_the_config(check, token_file, override, expected):
    code, out, err = check("data=tokens", f"data.path={token_file}", "model.vocab_size=256", override)
    if expected is None:
        assert code == 0 and "config OK" in out, err
    else:
        one_line_error(code, err, f"data=tokens: {token_file} (per its sidecar) ")
        assert expected in err, err


def test_check_bounds_eval_steps_by_the_validation_data(check, token_file):
    common = ("data=tokens", f"data.path={token_file}", "model.vocab_size=256", "eval.every=10")
    # 100,000 tokens: 1,562 samples of 64, 10% held out: 156 samples, 9 global batches of 16.
    code, out, err = check(*common, "data.val_fraction=0.1", "eval.steps=9")
    assert code == 0, err
    code, _, err = check(*common, "data.val_fraction=0.1", "eval.steps=100000000")
    one_line_error(code, err, "eval.steps=100000000 needs 100000000 global batches of 16 samples, but the "
                               f"validation data ({token_file} (validation split: its tokens 89,984 to the end)) holds 156 "
                               "samples: 9 batch(es); "
                               "set eval.steps<=9")
    code, _, err = check(*common, "data.val_fraction=0.001", "eval.steps=1")
    one_line_error(code, err, "holds 2 samples, fewer than one global batch of 16")
    code, _, err = check("eval.every=10", "eval.steps=100000000")
    one_line_error(code, err, "eval.steps=100000000 is more than training.steps=200")


def test_check_loads_the_tokenizer_of_a_text_corpus(check, tmp_path):
    (tmp_path / "c.txt").write_text("hello")
    code, _, err = check("data=text", f"data.paths={tmp_path / 'c.txt'}", "model.vocab_size=200")
    one_line_error(code, err, "data=text: tokenizer bytes has ids up to 255, which need vocab_size=256")
    code, _, err = check("data=text", f"data.paths={tmp_path / 'missing.txt'}")
    one_line_error(code, err, "data=text: no such data file(s)")


def _evaluator(source, steps=1):
    return Evaluator(source, global_batch_size=2, dp_rank=0, dp_size=1, every=1, steps=steps,
                     device=torch.device("cpu"))


def test_the_validation_split_is_checked_before_the_first_evaluation():
    tokens = np.zeros(41, dtype=np.uint16)
    tokens[37] = 900
    source = TokenWindows(tokens, 4, 256, name="v.bin")
    with pytest.raises(ValueError, match=r"^v.bin: token id 900 is outside the model's vocab_size=256 "
                                         r"\(token 37 of 41\)$"):
        _evaluator(source)
    tokens[37] = 0
    assert _evaluator(source, steps=5).steps == 5
    with pytest.raises(ValueError, match="eval.steps=6 needs 6 global batches of 2 samples, but the validation "
                                         r"data \(v.bin\) holds 10 samples: 5 batch\(es\); set eval.steps<=5"):
        _evaluator(source, steps=6)
