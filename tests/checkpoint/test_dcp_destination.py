"""Where import-dcp / export-dcp write: never onto their source or over a folder that is not a
checkpoint of the kind written (exit 2, one line, nothing touched), an old one replaced only
with --force, through a staging folder (a link planted in DST is never followed); and every
conversion command on fsspec URLs (memory://)."""

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from safetensors.torch import load as load_safetensors

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.cli import main


@pytest.fixture
def dcp_src(tmp_path):
    path = str(tmp_path / "dcp")
    torch_dcp.save({"w": torch.arange(6.0), "n": 3}, checkpoint_id=path, no_dist=True)
    return path


def _tree(path):
    return sorted((os.path.relpath(os.path.join(d, f), path), open(os.path.join(d, f), "rb").read())
                  for d, _, files in os.walk(path) for f in files)


def _refused(argv, capsys, match):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and match in err, err


def test_import_dcp_refuses_a_user_folder_and_its_own_source(dcp_src, tmp_path, capsys, monkeypatch):
    user = tmp_path / "user"
    (user / "sub").mkdir(parents=True)
    (user / "notes.txt").write_text("mine")
    (user / "sub" / "data.bin").write_bytes(b"x")
    before, source = _tree(user), _tree(dcp_src)
    _refused(["import-dcp", dcp_src, str(user)], capsys, "is not empty and holds 'sub'")
    (user / "sub" / "data.bin").unlink()
    (user / "sub").rmdir()
    _refused(["import-dcp", dcp_src, str(user)], capsys, "is not empty and is not a checkpoint of ours")
    assert _tree(user) == [b for b in before if b[0] == "notes.txt"]
    monkeypatch.chdir(tmp_path)
    os.symlink(dcp_src, tmp_path / "link")
    for dst in (dcp_src, "./dcp/", str(tmp_path / "link"), "user/../dcp"):
        _refused(["import-dcp", dcp_src, dst], capsys, "is the source")
    _refused(["import-dcp", "link", dcp_src], capsys, "is the source")
    assert _tree(dcp_src) == source


def test_import_dcp_replaces_a_checkpoint_of_ours_only_with_force(dcp_src, tmp_path, capsys):
    ours = str(tmp_path / "ours")
    assert main(["import-dcp", dcp_src, ours]) == 0
    _refused(["import-dcp", dcp_src, ours], capsys, "already holds a checkpoint of ours; pass --force")
    assert main(["import-dcp", dcp_src, ours, "--force", "--rename", "=model."]) == 0
    state = {"model": {"w": torch.zeros(6), "n": None}}
    hdcp.load(state, checkpoint_id=ours, no_dist=True)
    assert torch.equal(state["model"]["w"], torch.arange(6.0)) and state["model"]["n"] == 3
    (tmp_path / "empty").mkdir()  # an empty folder is written into
    assert main(["import-dcp", dcp_src, str(tmp_path / "empty")]) == 0
    assert hdcp.is_checkpoint(str(tmp_path / "empty"))
    assert sorted(os.listdir(tmp_path)) == ["dcp", "empty", "ours"]  # no staging folders left


def test_export_dcp_never_writes_through_a_link_planted_in_dst(dcp_src, tmp_path, capsys):
    ours = str(tmp_path / "ours")
    hdcp.import_dcp(dcp_src, ours)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    planted = tmp_path / "back"
    planted.mkdir()
    os.symlink(victim, planted / "__0_0.distcp")
    _refused(["export-dcp", ours, str(planted)], capsys, "holds '__0_0.distcp', which is not a file of a checkpoint")
    assert victim.read_bytes() == b"precious"
    back = str(tmp_path / "back2")
    assert main(["export-dcp", ours, back]) == 0
    _refused(["export-dcp", ours, back], capsys, "already holds a torch DCP checkpoint; pass --force")
    _refused(["export-dcp", ours, ours], capsys, "is the source")
    assert main(["export-dcp", ours, back, "--force"]) == 0
    state = {"w": torch.zeros(6), "n": None}
    torch_dcp.load(state, checkpoint_id=back, no_dist=True)
    assert torch.equal(state["w"], torch.arange(6.0)) and state["n"] == 3
    assert sorted(os.listdir(tmp_path)) == ["back", "back2", "dcp", "ours", "victim"]


def test_conversions_take_memory_urls(dcp_src, tmp_path, memory_url, capsys):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    root = memory_url[len("memory://"):].rsplit("/", 1)[0]
    fs.put(dcp_src, f"{root}/dcp", recursive=True)  # a DCP checkpoint on the object store
    src = f"memory://{root}/dcp"
    assert main(["import-dcp", src, memory_url, "--rename", "=model."]) == 0
    state = {"model": {"w": torch.zeros(6), "n": None}}
    hdcp.load(state, checkpoint_id=memory_url, no_dist=True)
    assert torch.equal(state["model"]["w"], torch.arange(6.0)) and state["model"]["n"] == 3
    _refused(["import-dcp", src, memory_url], capsys, "already holds a checkpoint of ours")
    _refused(["import-dcp", src, src], capsys, "is the source")

    back = f"memory://{root}/back"
    assert main(["export-dcp", memory_url, back]) == 0
    _refused(["export-dcp", memory_url, back], capsys, "already holds a torch DCP checkpoint")
    assert main(["export-dcp", memory_url, back, "--force"]) == 0
    local = str(tmp_path / "back")
    fs.get(f"{root}/back", local, recursive=True)
    loaded = {"model": {"w": torch.zeros(6), "n": None}}
    torch_dcp.load(loaded, checkpoint_id=local, no_dist=True)
    assert torch.equal(loaded["model"]["w"], torch.arange(6.0)) and loaded["model"]["n"] == 3

    hf = f"{root}/hf"
    assert main(["export-hf", memory_url, f"memory://{hf}"]) == 0
    index = json.loads(fs.cat_file(f"{hf}/model.safetensors.index.json"))
    assert index["weight_map"] == {"w": "model-00001-of-00001.safetensors"}
    tensors = load_safetensors(fs.cat_file(f"{hf}/model-00001-of-00001.safetensors"))
    assert torch.equal(tensors["w"], torch.arange(6.0))


@pytest.mark.parametrize("command, commit_file, content", [
    ("import-dcp", "metadata.json", b'{"experiment": "mine", "lr": 0.1}'),
    ("export-dcp", ".metadata", b"my own notes, not a pickle"),
])
def test_force_never_replaces_a_folder_that_only_looks_like_a_checkpoint(dcp_src, tmp_path, capsys, command,
                                                                          commit_file, content):
    """A user's own metadata.json (or .metadata) has a checkpoint's file name, not its content:
    the folder is not ours to delete, even with --force."""
    user = tmp_path / "user"
    user.mkdir()
    (user / commit_file).write_bytes(content)
    src = dcp_src
    if command == "export-dcp":
        src = str(tmp_path / "ours")
        assert main(["import-dcp", dcp_src, src]) == 0
    _refused([command, src, str(user), "--force"], capsys, "is not empty and is not a ")
    assert _tree(user) == [(commit_file, content)]
