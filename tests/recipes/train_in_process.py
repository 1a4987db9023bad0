"""``recipes/train.py`` imported into the test process (its ``main(argv) -> exit code``), and the
one-line error its ``--check`` prints for bad input."""

from __future__ import annotations

import importlib.util

from tests.recipes.launch import RECIPE

_spec = importlib.util.spec_from_file_location("train_recipe", RECIPE)
recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe)


def one_line_error(code: int, err: str, expected: str) -> None:
    """Exit code 2 and one ``error: `` line on stderr that contains ``expected``."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expected in lines[0], err
