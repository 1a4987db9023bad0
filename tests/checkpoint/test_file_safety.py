"""What the checkpoint package opens and writes. The lock file is never written through a
symbolic link or a hard link; a FIFO, device or directory where a checkpoint file belongs is refused
at once (no hang, no endless read); a metadata file beyond the size cap is refused unread; URLs
are refused instead of becoming a local ``s3:`` folder."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.filesystem import commit
from hyper_parallel.core.distributed_checkpoint.cli import main as cli_main
from hyper_parallel.checkpoint import LOCK_FILE
from tests.checkpoint.helpers import refused

# ---------------------------------------------------------------- the manager's lock file


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_lock_file_never_writes_into_another_file(tmp_path, link):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    folder = tmp_path / "ckpts"
    folder.mkdir()
    (os.symlink if link == "symlink" else os.link)(precious, folder / LOCK_FILE)
    with pytest.raises(hdcp.CheckpointError, match=LOCK_FILE):
        hdcp.CheckpointManager(str(folder))
    assert precious.read_text() == "keep me"


def test_dangling_lock_symlink_creates_nothing(tmp_path):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    os.symlink(tmp_path / "created-through-link", folder / LOCK_FILE)
    with pytest.raises(hdcp.CheckpointError, match="symbolic link"):
        hdcp.CheckpointManager(str(folder))
    assert not (tmp_path / "created-through-link").exists()


def test_rank_local_save_replaces_a_planted_tmp_link_instead_of_writing_through_it(tmp_path):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    path = tmp_path / "ckpt"
    path.mkdir()
    os.symlink(precious, path / "__0_0.safetensors.tmp")
    os.symlink(precious, path / "__0.values.json.tmp")
    hdcp.save({"w": torch.ones(3), "v": 1}, checkpoint_id=str(path), no_dist=True, use_collectives=False)
    assert precious.read_text() == "keep me"
    state = {"w": torch.zeros(3), "v": 0}
    hdcp.load(state, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(state["w"], torch.ones(3)) and state["v"] == 1


# ---------------------------------------------------------------- special files are refused


def _replace(path, make):
    os.remove(path)
    make(path)


@pytest.mark.timeout(60)
def test_fifo_as_metadata_is_refused_without_blocking(ckpt):
    _replace(os.path.join(ckpt, "metadata.json"), os.mkfifo)
    refused(ckpt, "metadata.json is a FIFO")
    assert not hdcp.is_checkpoint(ckpt)


@pytest.mark.timeout(60)
def test_fifo_as_rank_metadata_is_refused_without_blocking(ckpt):
    os.rename(os.path.join(ckpt, "metadata.json"), os.path.join(ckpt, "metadata.rank0.json"))
    _replace(os.path.join(ckpt, "metadata.rank0.json"), os.mkfifo)
    refused(ckpt, "metadata.rank0.json is a FIFO")


@pytest.mark.timeout(60)
def test_dev_zero_as_metadata_is_refused_without_reading_it(ckpt):
    _replace(os.path.join(ckpt, "metadata.json"), lambda p: os.symlink("/dev/zero", p))
    refused(ckpt, "metadata.json is a character device")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("special", ["fifo", "dev_zero", "directory"])
def test_special_data_file_is_refused_without_blocking(ckpt, special):
    data = sorted(glob.glob(os.path.join(ckpt, "*.safetensors")))[0]
    make = {"fifo": os.mkfifo, "dev_zero": lambda p: os.symlink("/dev/zero", p), "directory": os.mkdir}[special]
    _replace(data, make)
    refused(ckpt, f"{os.path.basename(data)} is a")


def test_metadata_directory_is_one_checkpoint_error(ckpt):
    _replace(os.path.join(ckpt, "metadata.json"), os.mkdir)
    refused(ckpt, "metadata.json is a directory")
    assert not hdcp.is_checkpoint(ckpt)


def test_metadata_beyond_the_cap_is_refused_unread(ckpt, monkeypatch):
    size = os.path.getsize(os.path.join(ckpt, "metadata.json"))
    monkeypatch.setattr(commit, "MAX_METADATA_BYTES", size - 1)
    refused(ckpt, f"metadata.json has {size} bytes, more than the {size - 1} bytes")
    monkeypatch.setattr(commit, "MAX_METADATA_BYTES", size)
    hdcp.verify_checkpoint(ckpt)


# ---------------------------------------------------------------- URLs


@pytest.mark.parametrize("url", ["s3://bucket/x", "gs://b/step-1", "file:///tmp/x"])
def test_urls_are_refused_by_the_posix_parts(tmp_path, monkeypatch, capsys, url):
    # (save/load/async_save/verify_checkpoint/read_checkpoint_metadata/CheckpointManager and the
    # CLI's commands take URLs: test_object_store.py, test_cli.py, test_dcp_destination.py, test_s3*.py)
    monkeypatch.chdir(tmp_path)
    calls = [lambda: hdcp.FileSystemWriter(url),
             lambda: hdcp.FileSystemReader(url)]
    for call in calls:
        with pytest.raises(ValueError, match="URL; this needs a file system path"):
            call()
    assert os.listdir(tmp_path) == []
    hdcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id="ckpt", no_dist=True)
    # a scheme fsspec does not know is refused in one line, never taken for a local folder
    assert cli_main(["export-hf", "ckpt", "nosuchscheme://x/y"]) == 1
    assert "nosuchscheme:// is no storage fsspec knows" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["ckpt"]
