"""The "Make a tokenizer" lines of docs/recipes.md, run as written on a tiny corpus (no downloads)."""

from __future__ import annotations

import json
import os
import re
import shlex

from tests.recipes.corpus import documents, write_corpus
from tests.recipes.script_main import script_main
from tests.recipes.train_in_process import recipe

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs",
                    "recipes.md")


def _section_blocks() -> dict:
    text = open(DOCS).read()
    section = text[text.index("### Make a tokenizer"):]
    section = section[: section.index("\n#", 1)]
    return {lang: body for lang, body in re.findall(r"```(\w+)\n(.*?)```", section, re.S)}


def test_the_make_a_tokenizer_snippet_runs(tmp_path, monkeypatch, capsys):
    blocks = _section_blocks()
    write_corpus(documents(30), str(tmp_path / "corpus"))
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks["python"], "docs/recipes.md", "exec"), {})
    assert json.load(open("tokenizer.json"))["model"]["type"] == "BPE"
    lines = [shlex.split(line.split("#")[0]) for line in blocks["bash"].strip().splitlines()]
    assert [line[:2] for line in lines] == [["scripts/prepare_data.py", "corpus/"], ["python", "recipes/train.py"]]
    assert script_main("prepare_data")([*lines[0][1:], "--quiet"]) == 0
    meta = json.load(open("corpus.bin.json"))
    assert meta["num_documents"] == 30 and meta["tokenizer"] == str(tmp_path / "tokenizer.json")
    assert meta["vocab_size"] <= 32_000 and meta["dtype"] == "uint16"
    capsys.readouterr()
    assert recipe.main([*lines[1][2:], f"output_dir={tmp_path / 'out'}"]) == 0, capsys.readouterr().err
    assert "config OK" in capsys.readouterr().out
