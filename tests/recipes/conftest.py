"""Fixtures shared by the recipe tests."""

import pytest

from tests.recipes.train_in_process import recipe


@pytest.fixture
def check(tmp_path, monkeypatch, capsys):
    """``check(*overrides) -> (exit code, stdout, stderr)`` of ``train.py --check`` on 2 ranks."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")

    def run(*overrides: str):
        code = recipe.main(["--check", f"output_dir={tmp_path / 'out'}", *overrides])
        out, err = capsys.readouterr()
        return code, out, err
    return run
