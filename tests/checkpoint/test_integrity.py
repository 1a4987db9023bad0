"""Corruption, truncation, missing pieces, crashes mid-save, and hostile files."""

from __future__ import annotations

import glob
import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import zlib

import pytest
import torch

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.filesystem import block_reads
from hyper_parallel.core.distributed_checkpoint.format.metadata import MetadataIndex
from tests.checkpoint.helpers import assert_state_equal, blank_state, full_state, load_and_check, save_layout

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _data_file(path):
    return sorted(glob.glob(os.path.join(path, "*.safetensors")))[0]


def _load(path, **kwargs):
    hdcp.load(blank_state(), checkpoint_id=path, no_dist=True, **kwargs)


def test_flipped_byte_is_caught_by_verify(ckpt):
    data_file = _data_file(ckpt)
    with open(data_file, "r+b") as f:
        f.seek(os.path.getsize(data_file) - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(hdcp.CheckpointError, match=f"checksum mismatch in {data_file}"):
        _load(ckpt, verify=True)
    with pytest.raises(hdcp.CheckpointError, match="checksum mismatch"):
        _load(ckpt, storage_reader=hdcp.FileSystemReader(ckpt, verify=True))
    with pytest.raises(hdcp.CheckpointError, match=f"{data_file} fails its checksum"):
        hdcp.verify_checkpoint(ckpt)


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("where", [0.0, 0.5, 1.0])
def test_flipped_byte_in_any_piece_of_a_chunk_is_caught(tmp_path, monkeypatch, where, layout):
    """A chunk is read and checksummed piece by piece (block_reads.PIECE_BYTES): a flip in the
    first, a middle or the last piece fails, read straight into the destination or (a strided
    destination) through the block buffer."""
    monkeypatch.setattr(block_reads, "PIECE_BYTES", 4096)  # a 16 KiB chunk in 4 pieces
    path = str(tmp_path / "ckpt")
    saved = torch.randn(64, 64)
    hdcp.save({"w": saved}, checkpoint_id=path, no_dist=True)
    info = hdcp.FileSystemReader(path).read_metadata().storage_data[MetadataIndex("w", (0, 0))]

    def target():
        return {"w": torch.zeros(64, 64) if layout == "contiguous" else torch.zeros(64, 64).t()}

    intact = target()
    hdcp.load(intact, checkpoint_id=path, no_dist=True)  # the pieces' crc32s add up to the chunk's
    assert torch.equal(intact["w"], saved)
    at = info.offset + int(where * (info.length - 1))
    data_file = os.path.join(path, info.relative_path)
    with open(data_file, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(hdcp.CheckpointError, match=f"checksum mismatch in {data_file} bytes "
                                                   f"{info.offset}..{info.offset + info.length}"):
        hdcp.load(target(), checkpoint_id=path, no_dist=True)
    hdcp.load(target(), checkpoint_id=path, no_dist=True, verify=False)  # unverified: loads


def test_truncated_file_is_refused(ckpt):
    data_file = _data_file(ckpt)
    os.truncate(data_file, os.path.getsize(data_file) - 100)
    with pytest.raises(hdcp.CheckpointError, match=f"{data_file} has .* bytes, metadata says"):
        _load(ckpt)
    with pytest.raises(hdcp.CheckpointError, match="metadata says"):
        hdcp.verify_checkpoint(ckpt)


def test_missing_metadata_is_not_a_checkpoint(ckpt):
    assert hdcp.is_checkpoint(ckpt)
    os.remove(os.path.join(ckpt, "metadata.json"))
    assert not hdcp.is_checkpoint(ckpt)
    with pytest.raises(hdcp.CheckpointError, match="metadata.json is missing"):
        _load(ckpt)


def test_missing_chunk_file_is_named(ckpt):
    data_file = _data_file(ckpt)
    os.remove(data_file)
    with pytest.raises(hdcp.CheckpointError, match=f"{data_file} is missing"):
        _load(ckpt)


def test_missing_chunk_in_metadata_is_named(ckpt):
    meta_path = os.path.join(ckpt, "metadata.json")
    with open(meta_path) as f:
        doc = json.load(f)
    doc["state_dict_metadata"]["model.layers.0.w"]["chunks"] = []
    with open(meta_path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(hdcp.CheckpointError, match="'model.layers.0.w'.*a chunk is missing"):
        _load(ckpt)


def test_paths_cannot_escape_the_checkpoint(ckpt):
    meta_path = os.path.join(ckpt, "metadata.json")
    with open(meta_path) as f:
        doc = json.load(f)
    doc["storage_data"][0]["file"] = "../../etc/passwd"
    with open(meta_path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(hdcp.CheckpointError, match="outside the checkpoint directory"):
        _load(ckpt)


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickles_are_never_executed(ckpt, tmp_path):
    marker = str(tmp_path / "pwned")
    evil = pickle.dumps(_Payload(marker))
    assert evil and not os.path.exists(marker)
    meta_path = os.path.join(ckpt, "metadata.json")
    with open(meta_path, "rb") as f:
        good_meta = f.read()
    # 1. metadata replaced by a pickle
    with open(meta_path, "wb") as f:
        f.write(evil)
    with pytest.raises(hdcp.CheckpointError, match="not valid checkpoint metadata JSON"):
        _load(ckpt)
    # 2. a value file replaced by a pickle (metadata still says JSON)
    with open(meta_path, "wb") as f:
        f.write(good_meta)
    values = os.path.join(ckpt, "__0.values.json")
    with open(values, "wb") as f:
        f.write(evil)
    with pytest.raises(hdcp.CheckpointError):
        _load(ckpt)
    # 3. metadata edited to claim a pickled value that covers the pickle bytes
    doc = json.loads(good_meta)
    for entry in doc["storage_data"]:
        if entry["fqn"] == "train.step":
            entry.update(byte_offset=0, length=len(evil), encoding="pickle", checksum=zlib.crc32(evil))
    doc["files"]["__0.values.json"]["size"] = len(evil)
    # (the other values would lie beyond the file: drop them so the metadata is consistent)
    doc["storage_data"] = [e for e in doc["storage_data"] if e["encoding"] == "raw" or e["fqn"] == "train.step"]
    doc["state_dict_metadata"] = {k: v for k, v in doc["state_dict_metadata"].items()
                                  if v["type"] == "tensor" or k == "train.step"}
    with open(meta_path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(hdcp.CheckpointError, match="'train.step' is pickled; refusing"):
        hdcp.load({"train": {"step": None}}, checkpoint_id=ckpt, no_dist=True)
    assert not os.path.exists(marker)


_SLOW_SAVE = textwrap.dedent("""
    import sys, time, torch
    from hyper_parallel import checkpoint as hdcp

    class SlowPlanner(hdcp.StandardSavePlanner):
        def get_data(self, item):
            print("writing", item.index.fqn, flush=True)
            time.sleep(0.05)
            return super().get_data(item)

    state = {f"w{i}": torch.full((256, 1024), float(i)) for i in range(64)}
    hdcp.save(state, checkpoint_id=sys.argv[1], no_dist=True, planner=SlowPlanner())
    print("done", flush=True)
""")


def test_kill_9_mid_save_keeps_previous_checkpoint(ckpt, tmp_path):
    script = tmp_path / "slow_save.py"
    script.write_text(_SLOW_SAVE)
    proc = subprocess.Popen([sys.executable, str(script), ckpt], stdout=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "HYPER_PARALLEL_DEVICE": "cpu"})
    try:
        deadline = time.monotonic() + 60
        writes = 0
        while writes < 5 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "the save process ended early"
            writes += line.startswith("writing")
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        proc.stdout.close()
    staging = glob.glob(os.path.join(os.path.dirname(ckpt), ".ckpt.staging-*"))
    assert len(staging) == 1 and glob.glob(os.path.join(staging[0], "*.safetensors"))
    assert not hdcp.is_checkpoint(staging[0])
    with pytest.raises(hdcp.CheckpointError, match="is not a committed checkpoint"):
        _load(staging[0])
    assert hdcp.is_checkpoint(ckpt)
    assert load_and_check(ckpt, [None], no_dist=True, verify=True)


def test_overwrite_replaces_atomically(ckpt):
    save_layout(ckpt, None, seed=1, no_dist=True)
    assert load_and_check(ckpt, [None], seed=1, no_dist=True, verify=True)
    leftovers = [p for p in os.listdir(os.path.dirname(ckpt)) if p != "ckpt"]
    assert leftovers == []


def test_thread_count_writes_and_reads_several_files(tmp_path):
    path = str(tmp_path / "ckpt")
    hdcp.save(full_state(), storage_writer=hdcp.FileSystemWriter(path, thread_count=3), no_dist=True)
    assert len(glob.glob(os.path.join(path, "__0_*.safetensors"))) == 3
    hdcp.verify_checkpoint(path)
    assert load_and_check(path, [None], no_dist=True, verify=True)
    target = blank_state()
    hdcp.load(target, storage_reader=hdcp.FileSystemReader(path, thread_count=3), no_dist=True)
    assert_state_equal(target, full_state())
