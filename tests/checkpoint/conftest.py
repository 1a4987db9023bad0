"""Fixtures shared by the checkpoint tests."""

import pytest
import torch.distributed as dist

from tests.checkpoint.helpers import save_layout


@pytest.fixture
def ckpt(tmp_path):
    """A small single-process checkpoint of the standard test layout."""
    path = str(tmp_path / "ckpt")
    save_layout(path, None, no_dist=True)
    return path


@pytest.fixture
def fake_process_group():
    """For tests that start torch's ``fake`` process group (``meta_state``): none before, none after."""
    assert not dist.is_initialized(), "a test left a process group behind"
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
