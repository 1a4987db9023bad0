"""``python -m hyper_parallel.checkpoint``: inspect, verify, export-hf (subprocess and in-process)."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from hyper_parallel import checkpoint as hdcp

from hyper_parallel.core.distributed_checkpoint.cli import main
from tests.checkpoint.helpers import save_fully_sharded_llama
from tests.multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "hyper_parallel.checkpoint", *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli") / "step-3")
    run_on_ranks(2, save_fully_sharded_llama, path, 11, timeout=120)
    return path


def test_inspect_lists_tensors_layouts_and_totals(checkpoint):
    result = _cli("inspect", checkpoint)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "step: 3" in out and "version 1" in out and "saved by 2 rank(s)" in out
    line = next(l for l in out.splitlines() if l.strip().startswith("model.tok_embeddings.weight "))
    assert "float32" in line and "256x64" in line and "64.00 KiB" in line
    assert "mesh 2 placements [S(0)]" in line  # fully_shard(mesh=None): torch's unnamed default mesh
    assert "optim.state.output.weight.exp_avg" in out
    assert "total tensor bytes:" in out and "values (" in out and "step" in out
    assert "mesh: not recorded" in out  # a library save has no recipe "parallel" entry


def test_verify_passes_then_detects_a_flipped_byte(checkpoint, tmp_path, capsys):
    assert main(["verify", checkpoint]) == 0
    assert capsys.readouterr().out.startswith("OK")
    corrupt = tmp_path / "step-3"
    subprocess.run(["cp", "-r", checkpoint, str(corrupt)], check=True)
    data_file = sorted(f for f in os.listdir(corrupt) if f.endswith(".safetensors"))[0]
    with open(corrupt / data_file, "r+b") as f:
        f.seek(os.path.getsize(corrupt / data_file) - 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    result = _cli("verify", corrupt)
    assert result.returncode == 1
    assert data_file in result.stderr and "corrupt" in result.stderr


def test_export_hf_and_errors(checkpoint, tmp_path, capsys):
    assert main(["export-hf", checkpoint, str(tmp_path / "hf"), "--max-shard-bytes", "200000"]) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert "tok_embeddings.weight" in index["weight_map"] and len(set(index["weight_map"].values())) > 1
    assert main(["inspect", str(tmp_path / "nothing")]) == 1
    assert "not a committed checkpoint" in capsys.readouterr().err


def test_inspect_into_a_reader_that_stops_early_exits_quietly(tmp_path):
    # ``inspect DIR | head -1``: more lines than a pipe holds, the reader closes after one.
    path = str(tmp_path / "step-1")
    hdcp.save({f"layer{i:04d}.weight": torch.zeros(1) for i in range(2000)}, checkpoint_id=path, no_dist=True)
    proc = subprocess.Popen([sys.executable, "-m", "hyper_parallel.checkpoint", "inspect", path], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().startswith(b"checkpoint: ")
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert err == b"" and proc.returncode == 128 + signal.SIGPIPE, err


def test_inspect_and_verify_take_a_manager_folder_and_name_the_step(tmp_path, capsys):
    folder = str(tmp_path / "checkpoints")
    manager = hdcp.CheckpointManager(folder)
    for step in (1, 2):
        manager.save(step, {"w": torch.full((3,), float(step)), "n": step})
    manager.close()
    os.makedirs(os.path.join(folder, "step-9"))  # not committed: never chosen
    newest = os.path.join(folder, "step-2")
    assert main(["inspect", folder]) == 0
    out = capsys.readouterr().out
    assert f"checkpoint: {newest} (the newest committed step in {folder})" in out
    assert "step: 2" in out and "n = 2" in out
    assert main(["verify", folder]) == 0
    assert capsys.readouterr().out.startswith(f"OK: {newest} (the newest committed step in {folder}): ")
    script = subprocess.run([sys.executable, "scripts/inspect_checkpoint.py", folder], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert script.returncode == 0 and "step: 2" in script.stdout, script.stderr
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    assert main(["verify", empty]) == 1
    assert "not a committed checkpoint (metadata.json is missing) nor a folder" in capsys.readouterr().err


def test_inspect_verify_list_on_a_memory_url(capsys):
    fsspec = pytest.importorskip("fsspec")
    folder = "memory://cli-test/run"
    try:
        manager = hdcp.CheckpointManager(folder)
        for step in (3, 5):
            manager.save(step, {"w": torch.full((3,), float(step)), "n": step})
        manager.close()
        assert main(["list", folder]) == 0 and capsys.readouterr().out.split() == ["step-3", "step-5"]
        assert main(["inspect", f"{folder}/step-3"]) == 0 and "n = 3" in capsys.readouterr().out
        assert main(["verify", folder]) == 0
        assert capsys.readouterr().out.startswith(f"OK: {folder}/step-5 (the newest committed step in {folder}): ")
        assert main(["list", "memory://cli-test/none"]) == 1
        assert "holds no committed step-N checkpoint" in capsys.readouterr().err
        assert main(["verify", "nosuchscheme://x/y"]) == 1
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
    finally:
        fsspec.filesystem("memory").rm("/cli-test", recursive=True)
