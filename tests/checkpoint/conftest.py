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
def memory_url(request):
    """A fresh ``memory://`` checkpoint URL, its prefix removed afterwards (the memory file
    system is process-wide)."""
    fsspec = pytest.importorskip("fsspec", reason="object storage needs fsspec (pip install 'hyper_parallel[s3]')")
    fs = fsspec.filesystem("memory")
    root = f"/{request.node.name.replace('[', '-').replace(']', '')}"
    yield f"memory://{root}/step-1"
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture
def fake_process_group():
    """For tests that start torch's ``fake`` process group (``meta_state``): none before, none after."""
    assert not dist.is_initialized(), "a test left a process group behind"
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
