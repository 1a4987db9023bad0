"""scripts/prepare_data.py and the corpus readers on hostile or careless input:
outputs that are inputs, token ids that do not fit the dtype, malformed files and sidecars."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from hyper_parallel.data import build_source, iter_documents, prepare_tokens, read_sidecar
from tests.recipes.script_main import script_main


def _prepare_data(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    try:
        code = script_main("prepare_data")([*args, "--quiet"])
    except SystemExit as exit_:  # argparse
        code = exit_.code
    return code, capsys.readouterr().err.strip()


def _one_error_line(err: str, expected: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err


def test_an_output_that_is_an_input_is_refused(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("precious text")
    (tmp_path / "link.bin").symlink_to(corpus)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.txt").write_text("more text")
    cases = [
        ([str(corpus), "--output", str(corpus)], "would overwrite the input"),
        ([str(corpus), "--output", str(tmp_path / "link.bin")], "would overwrite the input"),
        ([str(tmp_path / "dir"), "--output", str(tmp_path / "dir" / "a.txt")], "would overwrite the input"),
        ([str(tmp_path / "dir"), "--output", str(tmp_path / "dir" / "new.jsonl")], "lies in the input folder"),
        ([str(tmp_path / "corpus.txt.json"), "--output", str(corpus)], "would overwrite the input"),
        ([str(corpus), "--output", str(tmp_path / "dir")], "is a folder"),
    ]
    (tmp_path / "corpus.txt.json").write_text('{"text": "a sidecar path used as input"}')
    for args, expected in cases:
        code, err = _prepare_data(capsys, *args)
        assert code == 1, err
        _one_error_line(err, expected)
    assert corpus.read_text() == "precious text" and (tmp_path / "dir" / "a.txt").read_text() == "more text"
    assert os.path.islink(tmp_path / "link.bin") and not list(tmp_path.glob("**/*.partial"))
    # a token file next to the corpus folder's files, but not one the folder scan reads, is fine
    assert _prepare_data(capsys, str(tmp_path / "dir"), "--output", str(tmp_path / "dir" / "tokens.bin"))[0] == 0


def test_a_stale_partial_file_is_reported_and_the_old_output_kept(tmp_path, capsys):
    (tmp_path / "c.txt").write_text("hello")
    out = tmp_path / "t.bin"
    assert _prepare_data(capsys, str(tmp_path / "c.txt"), "--output", str(out))[0] == 0
    before = out.read_bytes(), (tmp_path / "t.bin.json").read_text()
    (tmp_path / "c.txt").write_text("a longer text now")
    for stale in ("t.bin.partial", "t.bin.json.partial"):
        (tmp_path / stale).symlink_to(tmp_path / "c.txt")  # never written through
        code, err = _prepare_data(capsys, str(tmp_path / "c.txt"), "--output", str(out))
        assert code == 1 and (tmp_path / "c.txt").read_text() == "a longer text now"
        _one_error_line(err, f"{tmp_path / stale} exists")
        assert f"rm {tmp_path / stale}" in err
        assert (out.read_bytes(), (tmp_path / "t.bin.json").read_text()) == before
        assert not (tmp_path / "t.bin.partial").exists() or stale == "t.bin.partial"
        os.remove(tmp_path / stale)


def _sparse_tokenizer(path: str) -> str:
    """A word-level tokenizer of 4 entries whose ids go up to 70,001."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<unk>": 1, "alpha": 70_000, "beta": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(path)
    return path


def test_ids_above_65535_are_stored_as_uint32_not_wrapped(tmp_path):
    tokenizer = _sparse_tokenizer(str(tmp_path / "tokenizer.json"))
    (tmp_path / "c.txt").write_text("alpha beta gamma")
    out = str(tmp_path / "t.bin")
    meta = prepare_tokens([str(tmp_path / "c.txt")], out, tokenizer=tokenizer)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_002
    np.testing.assert_array_equal(np.fromfile(out, dtype=np.uint32), [70_000, 70_001, 1])
    source = build_source("tokens", seq_len=2, vocab_size=70_002, seed=0, path=out, dtype="uint32")
    assert source.samples([0]).tolist() == [[70_000, 70_001, 1]]
    with pytest.raises(ValueError, match="has ids up to 70001, which need vocab_size=70002, more than "
                                         "model.vocab_size=4"):
        build_source("text", seq_len=2, vocab_size=4, seed=0, paths=str(tmp_path / "c.txt"), tokenizer=tokenizer)


@pytest.mark.parametrize("flag", ["--workers", "--docs-per-chunk"])
@pytest.mark.parametrize("value", ["0", "-3", "two"])
def test_nonsense_counts_are_refused_by_the_parser(tmp_path, capsys, flag, value):
    (tmp_path / "c.txt").write_text("hello")
    code, err = _prepare_data(capsys, str(tmp_path / "c.txt"), "--output", str(tmp_path / "t.bin"), flag, value)
    assert code == 2 and not (tmp_path / "t.bin").exists()
    _one_error_line(err, f"argument {flag}: {value!r} is not an integer >= 1")
    with pytest.raises(ValueError, match="must be a positive integer"):
        prepare_tokens([str(tmp_path / "c.txt")], str(tmp_path / "t.bin"),
                       **{flag[2:].replace("-", "_"): 0})


def test_malformed_corpus_files_give_one_line_naming_file_and_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, column in (("ints", [1, 2]), ("bytes", [b"x", b"y"]), ("lists", [["a"], ["b"]])):
        pq.write_table(pa.table({"text": column}), tmp_path / f"{name}.parquet")
        with pytest.raises(ValueError) as err:
            list(iter_documents(str(tmp_path / f"{name}.parquet")))
        assert str(err.value).startswith(f"{tmp_path / name}.parquet: the 'text' column holds ")
        assert str(err.value).endswith(", not strings")
    raw = pa.array([b"fine", b"\xff\xfe"], type=pa.binary())
    pq.write_table(pa.table({"text": pa.Array.from_buffers(pa.string(), 2, raw.buffers())}), tmp_path / "u.parquet")
    with pytest.raises(ValueError, match=f"^{tmp_path / 'u.parquet'}: row 2: not UTF-8 text \\(invalid start byte\\)$"):
        list(iter_documents(str(tmp_path / "u.parquet")))
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"text": "ok"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match=f"^{deep}:2: JSON nested too deeply to read$"):
        list(iter_documents(str(deep)))
    bad_utf8 = tmp_path / "bad.jsonl"
    bad_utf8.write_bytes(b'{"text": "ok"}\n{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=f"^{bad_utf8}:3: not UTF-8 text \\(invalid start byte at byte 10\\)$"):
        list(iter_documents(str(bad_utf8)))
    bad_txt = tmp_path / "bad.txt"
    bad_txt.write_bytes(b"line one\nline two \xc3\n")
    with pytest.raises(ValueError, match=f"^{bad_txt}:2: not UTF-8 text"):
        list(iter_documents(str(bad_txt)))
    (tmp_path / "list.jsonl").write_text('{"text": ["a"]}\n')
    with pytest.raises(ValueError, match="list.jsonl:1: the 'text' field is a list, not a string"):
        list(iter_documents(str(tmp_path / "list.jsonl")))


@pytest.mark.parametrize("key,value,expected", [
    ("num_tokens", "12", "the sidecar's 'num_tokens' is '12', not a non-negative integer"),
    ("num_tokens", 1.5, "the sidecar's 'num_tokens' is 1.5, not a non-negative integer"),
    ("num_tokens", None, "the sidecar's 'num_tokens' is None, not a non-negative integer"),
    ("dtype", "int8", "the sidecar's 'dtype' is 'int8', not uint16 or uint32"),
    ("vocab_size", True, "the sidecar's 'vocab_size' is True, not a positive integer"),
    ("vocab_size", 0, "the sidecar's 'vocab_size' is 0, not a positive integer"),
    ("tokenizer", 7, "the sidecar's 'tokenizer' is 7, not a tokenizer name"),
    ("eos_id", "x", "the sidecar's 'eos_id' is 'x', not null or a non-negative integer"),
    ("num_documents", ..., "the sidecar has no 'num_documents' field"),
])
def test_a_damaged_sidecar_is_named_field_by_field(tmp_path, key, value, expected):
    (tmp_path / "c.txt").write_text("hello world")
    out = str(tmp_path / "t.bin")
    meta = prepare_tokens([str(tmp_path / "c.txt")], out)
    assert read_sidecar(out) == meta
    if value is ...:
        del meta[key]
    else:
        meta[key] = value
    with open(out + ".json", "w") as f:
        json.dump(meta, f)
    with pytest.raises(ValueError) as err:
        build_source("tokens", seq_len=4, vocab_size=256, seed=0, path=out, dtype="uint16")
    assert str(err.value).startswith(f"{out}.json: {expected}") and "re-create it" in str(err.value)
