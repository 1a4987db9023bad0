"""Fixtures shared by the recipe tests."""

import pytest

from tests.recipes import launch
from tests.recipes.train_in_process import recipe


@pytest.fixture(scope="session", autouse=True)
def _end_launched_jobs():
    """Kill the recipe jobs a test started that still run when the session ends, also when
    it ends by Ctrl-C (pytest tears its fixtures down then; launch.py's atexit does too)."""
    yield
    launch.end_all()


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
