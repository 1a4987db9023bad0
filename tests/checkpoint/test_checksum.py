"""The checkpoint checksum: ISA-L's crc32 when installed, zlib's otherwise (said once in the
log), same values."""

import importlib
import logging
import os
import sys
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


@pytest.fixture
def without_isal(monkeypatch):
    """The checksum module as imported where ``isal`` is not importable; the real one afterwards."""
    monkeypatch.setitem(sys.modules, "isal", None)  # None in sys.modules: the import raises ImportError
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)
    yield importlib.reload(checksum)
    monkeypatch.undo()
    importlib.reload(checksum)
    assert checksum.CRC32_IMPLEMENTATION == "isal"


def test_without_isal_zlib_gives_the_same_values_and_says_so_once(tmp_path, caplog, without_isal):
    assert without_isal.CRC32_IMPLEMENTATION == "zlib" and "crc32 by zlib" in without_isal.describe_crc32()
    caplog.set_level(logging.WARNING)
    data = os.urandom(100_003)
    for start in (0, 1, 0xDEADBEEF):
        assert without_isal.crc32(memoryview(data), start) == isal_zlib.crc32(data, start)
    path = str(tmp_path / "ckpt")  # and the checksums of a save and a verified load
    hdcp.save(_mixed_state(), checkpoint_id=path, no_dist=True)
    target = {"w": torch.zeros(37, 11), "b": torch.zeros(5, dtype=torch.bfloat16), "step": 0, "name": ""}
    hdcp.load(target, checkpoint_id=path, no_dist=True, verify=True)
    assert torch.equal(target["w"], _mixed_state()["w"])
    warnings = [r for r in caplog.records if r.name == checksum.__name__ and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "'isal'" in warnings[0].getMessage() and "zlib" in warnings[0].getMessage()


def test_with_isal_nothing_is_logged(caplog):
    caplog.set_level(logging.WARNING)
    crc32(os.urandom(1000))
    assert checksum.describe_crc32() == "crc32 by isal"
    assert not [r for r in caplog.records if r.name == checksum.__name__]
