"""docs/moe.md's snippets run as written: in order, in one namespace, on 2 gloo ranks (as
``torchrun --nproc_per_node=2`` would run them), and do what the page says they do."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from tests.multirank import run_on_ranks

DOC = Path(__file__).parents[1] / "docs" / "moe.md"


def _snippets():
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def _run_snippets(folder: str, snippets):
    scope: dict = {}
    cwd = os.getcwd()
    os.chdir(folder)  # the snippets write moe-run/ and moe-hf/ under the working directory
    try:
        for snippet in snippets:
            exec(compile(snippet, str(DOC), "exec"), scope)  # noqa: S102 - the docs' own code
    finally:
        os.chdir(cwd)
    full = {name: p.full_tensor() for name, p in scope["model"].named_parameters()}
    loaded = {name: p.full_tensor() for name, p in scope["loaded"].named_parameters()}
    return {"loss": scope["loss"].item(), "aux": scope["aux"].item(), "counts": scope["counts"],
            "same_after_export_and_load": all(torch.equal(full[n], loaded[n]) for n in full),
            "pipeline_losses": [x.item() for x in scope["losses"]], "dtype": scope.get("dtype")}


def test_every_moe_md_snippet_runs_as_written(tmp_path):
    snippets = _snippets()
    assert len(snippets) == 4
    results = run_on_ranks(2, _run_snippets, str(tmp_path), snippets, timeout=240)
    for result in results:
        assert 0 < result["loss"] < 10 and result["aux"] > 0
        assert [int(c.sum()) for c in result["counts"].values()] == [4 * 32 * 2] * 2  # tokens x top_k per block
        assert result["same_after_export_and_load"]  # the Qwen3-MoE export loads back exactly
    assert results[0]["dtype"] == torch.float32 and results[1]["dtype"] is None  # rank 0 exported
    assert not results[0]["pipeline_losses"] and len(results[1]["pipeline_losses"]) == 2  # the last stage's
    config = (tmp_path / "moe-hf" / "config.json").read_text()
    assert '"dtype": "float32"' in config and '"torch_dtype": "float32"' in config
