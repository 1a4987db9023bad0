"""Hostile checkpoints: edited metadata, oversized lengths and headers, corruption
without asking for verification. ``load`` and the CLI ``verify`` refuse each one with
``CheckpointError`` naming the problem, before allocating anything sized by the file."""

from __future__ import annotations

import glob
import json
import os
import tracemalloc
import zlib

import pytest
import torch

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.cli import main as cli_main
from tests.checkpoint.helpers import blank_state, refused


def _doc(path):
    with open(os.path.join(path, "metadata.json")) as f:
        return json.load(f)


def _write_doc(path, doc):
    with open(os.path.join(path, "metadata.json"), "w") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))


def _entry(doc, fqn):
    return next(e for e in doc["storage_data"] if e["fqn"] == fqn)


def test_overlapping_chunks_hiding_a_gap_are_refused_even_with_valid_checksums(ckpt):
    # layers.0.b has 5 float32s: claim chunks [0, 3) and [1, 4) (4 elements overlap-free would
    # be needed; element 4 is never covered), each stored at real bytes with real crc32s.
    doc = _doc(ckpt)
    fqn = "model.layers.0.b"
    entry = _entry(doc, fqn)
    doc["state_dict_metadata"][fqn]["chunks"] = [{"offsets": [0], "sizes": [3]}, {"offsets": [1], "sizes": [2]}]
    with open(os.path.join(ckpt, entry["file"]), "rb") as f:
        data = f.read()
    start = entry["byte_offset"]
    doc["storage_data"].remove(entry)
    for off, n, at in ((0, 3, start), (1, 2, start + 12)):
        doc["storage_data"].append({**entry, "offset": [off], "byte_offset": at, "length": 4 * n,
                                    "checksum": zlib.crc32(data[at:at + 4 * n])})
    _write_doc(ckpt, doc)
    refused(ckpt, "overlap")


def test_gap_and_out_of_bounds_chunks_are_refused(ckpt):
    doc = _doc(ckpt)
    fqn = "model.layers.0.b"
    doc["state_dict_metadata"][fqn]["chunks"] = [{"offsets": [0], "sizes": [4]}]
    entry = _entry(doc, fqn)
    entry["offset"], entry["length"] = [0], 16
    _write_doc(ckpt, doc)
    refused(ckpt, "cover 4 of its 5 elements")
    doc["state_dict_metadata"][fqn]["chunks"] = [{"offsets": [2], "sizes": [5]}]
    entry["offset"], entry["length"] = [2], 20
    _write_doc(ckpt, doc)
    refused(ckpt, "lies outside")


def test_flipped_byte_is_caught_by_default_and_verify_false_opts_out(ckpt):
    data_file = sorted(glob.glob(os.path.join(ckpt, "*.safetensors")))[0]
    with open(data_file, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(hdcp.CheckpointError, match="checksum mismatch"):
        hdcp.load(blank_state(), checkpoint_id=ckpt, no_dist=True)
    with pytest.raises(hdcp.CheckpointError, match="checksum mismatch"):
        hdcp.load(blank_state(), storage_reader=hdcp.FileSystemReader(ckpt), no_dist=True)
    hdcp.load(blank_state(), checkpoint_id=ckpt, no_dist=True, verify=False)  # opted out: loads
    hdcp.load(blank_state(), storage_reader=hdcp.FileSystemReader(ckpt, verify=False), no_dist=True)


def _deep(n):
    return "[" * n + "]" * n


@pytest.mark.parametrize("edit, match", [
    (lambda d: d["layouts"].update({"model.norm.weight": {"x": json.loads(_deep(100))}}), "nests deeper"),
    (lambda d: "RAW" + json.dumps(d, separators=(",", ":")).replace('"layouts":{', '"layouts":{"deep":' + _deep(200000) + ","),
     "not valid checkpoint metadata JSON"),
    (lambda d: d["state_dict_metadata"]["model.norm.weight"].update(size="abc"), "size must be a list"),
    (lambda d: d["state_dict_metadata"]["model.norm.weight"].update(chunks=7), "chunks must be a list"),
    (lambda d: d.update(storage_data={"a": 1}), "storage_data must be a list"),
    (lambda d: d["state_dict_metadata"].update({"x": []}), "must be an object"),
    (lambda d: d.update(world_size="2"), "world_size must be an integer"),
    (lambda d: _entry(d, "model.norm.weight").update(byte_offset=-5), "byte_offset must be an integer"),
    (lambda d: _entry(d, "model.norm.weight").update(length=7), "has 7 bytes"),
    (lambda d: _entry(d, "model.norm.weight").update(file="../x"), "outside the checkpoint directory"),
    (lambda d: _entry(d, "model.norm.weight").update(file={"a": 1}), "names file {'a': 1}"),
    (lambda d: _entry(d, "train.step").update(length=6 << 30), "ends at byte"),
    (lambda d: d["files"][_entry(d, "model.norm.weight")["file"]].update(size=None), "size must be an integer"),
])
def test_hostile_metadata_raises_checkpoint_error(ckpt, edit, match):
    doc = _doc(ckpt)
    out = edit(doc)
    _write_doc(ckpt, out[3:] if isinstance(out, str) else doc)
    tracemalloc.start()
    try:
        refused(ckpt, match)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 << 20, f"refusing the checkpoint allocated {peak} bytes"


def test_value_length_beyond_the_file_is_refused_before_allocating(ckpt):
    # The metadata still agrees with itself (file size raised too); the file on disk is shorter.
    doc = _doc(ckpt)
    entry = max((e for e in doc["storage_data"] if e["encoding"] == "json"), key=lambda e: e["byte_offset"])
    entry["length"] = 6 << 30
    doc["files"][entry["file"]]["size"] = entry["byte_offset"] + entry["length"]
    _write_doc(ckpt, doc)
    tracemalloc.start()
    try:
        refused(ckpt, "has .* bytes, metadata says")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 << 20, f"refusing the checkpoint allocated {peak} bytes"


def test_values_nested_too_deep_are_refused_by_load_and_verify(tmp_path):
    path = str(tmp_path / "ckpt")
    hdcp.save({"v": 1}, checkpoint_id=path, no_dist=True)
    doc = _doc(path)
    entry = _entry(doc, "v")
    data = _deep(150).encode()
    with open(os.path.join(path, entry["file"]), "wb") as f:
        f.write(b'{"v":' + data + b"}")
    entry.update(byte_offset=5, length=len(data), checksum=zlib.crc32(data))
    blob = b'{"v":' + data + b"}"
    doc["files"][entry["file"]] = {"size": len(blob), "checksum": zlib.crc32(blob)}
    _write_doc(path, doc)
    with pytest.raises(hdcp.CheckpointError, match="nests deeper"):
        hdcp.load({"v": None}, checkpoint_id=path, no_dist=True)
    with pytest.raises(hdcp.CheckpointError, match="nests deeper"):
        hdcp.verify_checkpoint(path)
    assert cli_main(["verify", path]) == 1


def test_value_relabelled_as_pickle_is_refused_by_verify_as_by_load(ckpt):
    doc = _doc(ckpt)
    _entry(doc, "train.step")["encoding"] = "pickle"
    _write_doc(ckpt, doc)
    refused(ckpt, "'train.step' is pickled; refusing")
    hdcp.verify_checkpoint(ckpt, allow_pickle=True)  # the bytes match their checksums (never unpickled)


def test_verify_of_a_pickled_checkpoint_needs_the_same_opt_in_as_load(tmp_path, capsys):
    path = str(tmp_path / "ckpt")
    hdcp.save({"w": torch.ones(2), "s": {1, 2}}, storage_writer=hdcp.FileSystemWriter(path, allow_pickle=True),
              no_dist=True)
    with pytest.raises(hdcp.CheckpointError, match="'s' is pickled"):
        hdcp.verify_checkpoint(path)
    assert cli_main(["verify", path]) == 1 and "--allow-pickle" in capsys.readouterr().err
    hdcp.verify_checkpoint(path, allow_pickle=True)
    assert cli_main(["verify", "--allow-pickle", path]) == 0


def test_damaged_pickle_with_a_matching_checksum_is_a_checkpoint_error(tmp_path):
    path = str(tmp_path / "ckpt")
    hdcp.save({"s": {1, 2}}, storage_writer=hdcp.FileSystemWriter(path, allow_pickle=True), no_dist=True)
    doc = _doc(path)
    entry = _entry(doc, "s")
    data = b"\x80\x04garbage."
    with open(os.path.join(path, entry["file"]), "wb") as f:
        f.write(data)
    entry.update(byte_offset=0, length=len(data), checksum=zlib.crc32(data))
    doc["files"][entry["file"]] = {"size": len(data), "checksum": zlib.crc32(data)}
    _write_doc(path, doc)
    with pytest.raises(hdcp.CheckpointError, match="'s' is not a valid pickle"):
        hdcp.load({"s": None}, storage_reader=hdcp.FileSystemReader(path, allow_pickle=True), no_dist=True)


def test_hf_import_caps_the_safetensors_header(tmp_path):
    path = tmp_path / "model.safetensors"
    length = 200_000_000  # a sparse file: the header "fits" in the file but exceeds the cap
    with open(path, "wb") as f:
        f.write(length.to_bytes(8, "little"))
        f.truncate(8 + length + 16)
    tracemalloc.start()
    try:
        with pytest.raises(hdcp.CheckpointError, match="refusing headers over"):
            hdcp.load_hf({"w": torch.zeros(2)}, str(tmp_path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


def test_hf_import_refuses_a_tensor_beyond_its_file(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(4.0)}, str(path))
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header["w"]["data_offsets"] = [0, 16 + (6 << 30)]
    header["w"]["shape"] = [4 + (6 << 30) // 4]
    body = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(body).to_bytes(8, "little") + body + b"\0" * 16)
    with pytest.raises(hdcp.CheckpointError, match="ends at byte"):
        hdcp.load_hf({"w": torch.zeros(2)}, str(tmp_path))
    header["w"]["shape"] = "x"
    body = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(body).to_bytes(8, "little") + body + b"\0" * 16)
    with pytest.raises(hdcp.CheckpointError, match="malformed header entry"):
        hdcp.load_hf({"w": torch.zeros(2)}, str(tmp_path))
