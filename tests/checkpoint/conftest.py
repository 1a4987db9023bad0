"""Fixtures shared by the checkpoint tests."""

import pytest

from tests.checkpoint.helpers import save_layout


@pytest.fixture
def ckpt(tmp_path):
    """A small single-process checkpoint of the standard test layout."""
    path = str(tmp_path / "ckpt")
    save_layout(path, None, no_dist=True)
    return path
