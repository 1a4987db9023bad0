"""The checkpoint checksum: ISA-L's crc32 when installed, zlib's otherwise, same values."""

import os
import zlib

import pytest
import torch
from isal import isal_zlib

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.format import checksum
from hyper_parallel.core.distributed_checkpoint.format.checksum import crc32, crc32_combine


def test_the_fast_crc32_is_used():
    assert checksum.CRC32_IMPLEMENTATION == "isal"
    data = os.urandom(1 << 16)
    assert crc32(data) == isal_zlib.crc32(data)


@pytest.mark.parametrize("length", [0, 1, 3, 7, 64, 4095, 4097, (1 << 20) + 13])
@pytest.mark.parametrize("start", [0, 1, 0xDEADBEEF, 0xFFFFFFFF])
def test_isal_and_zlib_agree_on_any_length_and_running_value(length, start):
    data = os.urandom(length)
    assert isal_zlib.crc32(data, start) == zlib.crc32(data, start)
    assert crc32(memoryview(data), start) == zlib.crc32(data, start)


def test_a_running_crc_over_odd_pieces_equals_the_whole_and_combines():
    data = os.urandom(300_001)
    cuts = [0, 1, 4, 1000, 65_537, 200_003, len(data)]
    running = 0
    for a, b in zip(cuts, cuts[1:]):
        running = isal_zlib.crc32(data[a:b], running)
    assert running == zlib.crc32(data)
    head, tail = data[:65_537], data[65_537:]
    assert crc32_combine(crc32(head), crc32(tail), len(tail)) == zlib.crc32(data)


def _mixed_state():
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(37, 11, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "step": 7, "name": "x"}


@pytest.mark.parametrize("writer, reader", [(zlib.crc32, isal_zlib.crc32), (isal_zlib.crc32, zlib.crc32)])
def test_checkpoints_written_with_either_verify_with_the_other(tmp_path, monkeypatch, writer, reader):
    path = str(tmp_path / "ckpt")
    monkeypatch.setattr(checksum, "_crc32", writer)
    hdcp.save(_mixed_state(), checkpoint_id=path, no_dist=True)
    monkeypatch.setattr(checksum, "_crc32", reader)
    hdcp.verify_checkpoint(path)
    target = {"w": torch.zeros(37, 11), "b": torch.zeros(5, dtype=torch.bfloat16), "step": 0, "name": ""}
    hdcp.load(target, checkpoint_id=path, no_dist=True, verify=True)
    expected = _mixed_state()
    assert torch.equal(target["w"], expected["w"]) and torch.equal(target["b"], expected["b"])
    assert (target["step"], target["name"]) == (7, "x")
