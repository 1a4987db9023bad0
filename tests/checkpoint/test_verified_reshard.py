"""Verified resharding loads: a chunk several ranks need parts of is read whole and checked by
one of them (verify_plan.py), the others read only their bytes, and corruption anywhere in it
still fails the load on every rank."""

from __future__ import annotations

import os
import zlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.filesystem import block_reads
from hyper_parallel.core.distributed_checkpoint.filesystem.block_reads import BlockReads
from hyper_parallel.core.distributed_checkpoint.format.metadata import MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlan, ReadItem
from hyper_parallel.core.distributed_checkpoint.planning.verify_plan import assign_duties, duties_of, mark_local_plan
from tests.checkpoint.helpers import counting_reads
from tests.multirank import run_on_ranks

T = 120
# fp32: two stored chunks of 8 x 8192 (256 KiB) when saved on 2 ranks; a Shard(1) half-row is
# 16 KiB, far enough from the next one to be read piece by piece (not as whole rows).
ROWS, COLS = 16, 8192


def _arange_full() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).view(ROWS, COLS)


def _save_on_ranks(path):
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    hdcp.save({"w": distribute_tensor(_arange_full(), mesh, (Shard(0),))}, checkpoint_id=path)


def _load_sharded(path, dim, verify=True):
    """Bytes this rank read, or the CheckpointError's message; the loaded values: the saved ones,
    or (unverified) the saved ones with one element changed."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    target = {"w": distribute_tensor(torch.zeros(ROWS, COLS), mesh, (Shard(dim),))}
    with counting_reads() as read:
        try:
            hdcp.load(target, checkpoint_id=path, verify=verify)
        except hdcp.CheckpointError as exc:
            return str(exc)
    differ = (target["w"].full_tensor() != _arange_full()).sum().item()
    assert differ == 0 or (not verify and differ == 1), differ
    return sum(read)


@pytest.mark.parametrize("load_world, dim", [(2, 1), (4, 0)], ids=["shard0-to-shard1", "fsdp-2-to-4-ranks"])
def test_each_partly_needed_chunk_is_read_whole_once(tmp_path, load_world, dim):
    path = str(tmp_path / "ckpt")
    run_on_ranks(2, _save_on_ranks, path, timeout=T)
    chunk = ROWS * COLS * 4 // 2
    reads = run_on_ranks(load_world, _load_sharded, path, dim, timeout=T)
    unverified = run_on_ranks(load_world, _load_sharded, path, dim, False, timeout=T)
    assert sum(unverified) == 2 * chunk  # every stored byte once
    # One reader per chunk reads it whole to check it; the others read only their part:
    # 1.5x the stored bytes, where reading whole on every rank that needs a part was 2x.
    assert sum(reads) == 3 * chunk, reads
    assert max(reads) - min(reads) <= chunk // 2, reads  # the checks are spread over the ranks


def _corrupt(path, row, col):
    metadata = hdcp.FileSystemReader(path).read_metadata()
    first = (row // (ROWS // 2)) * (ROWS // 2)
    info = metadata.storage_data[MetadataIndex("w", (first, 0))]
    with open(os.path.join(path, info.relative_path), "r+b") as f:
        at = info.offset + ((row - first) * COLS + col) * 4
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("row, col", [(1, 3), (1, 6000), (12, 3), (12, 6000)])
def test_corruption_in_any_rank_s_part_fails_the_load_everywhere(tmp_path, row, col):
    path = str(tmp_path / "ckpt")
    run_on_ranks(2, _save_on_ranks, path, timeout=T)
    _corrupt(path, row, col)
    # Each corrupted element is used by one rank only; half the cases by the rank that does
    # not check that chunk.
    messages = run_on_ranks(2, _load_sharded, path, 1, timeout=T)
    assert all(isinstance(m, str) and "checksum mismatch" in m for m in messages), messages
    assert isinstance(run_on_ranks(2, _load_sharded, path, 1, False, timeout=T)[0], int)  # unverified: loads


def _plan(items):
    return LoadPlan([ReadItem(LoadItemType.TENSOR, MetadataIndex("w", (0,)), (0,), MetadataIndex(fqn, (0,)),
                              (start,), (length,)) for fqn, start, length in items])


def test_assign_duties_checks_each_partly_read_chunk_once_by_a_verifying_reader():
    sizes = {MetadataIndex(f, (0,)): (n * 4, 4) for f, n in (("a", 10), ("b", 10), ("c", 6), ("d", 8))}
    plans = [mark_local_plan(_plan([("a", 0, 5), ("b", 0, 5), ("c", 0, 6)]), True),
             mark_local_plan(_plan([("a", 5, 5), ("b", 5, 5), ("c", 0, 3), ("d", 0, 4)]), True),
             mark_local_plan(_plan([("d", 4, 4)]), False)]
    duties = [duties_of(p) for p in assign_duties(plans, sizes)]
    assert duties[2] == frozenset()  # verify=False on that rank: it checks nothing
    assert MetadataIndex("c", (0,)) not in duties[0] | duties[1]  # rank 0 reads c whole: checked anyway
    assert MetadataIndex("d", (0,)) in duties[1]  # the only verifying reader of d
    # a and b each go to exactly one of their two readers, one each (balanced).
    assert {len(duties[0] & {MetadataIndex("a", (0,)), MetadataIndex("b", (0,))}), len(duties[1] - {
        MetadataIndex("d", (0,))})} == {1}
    assert duties_of(plans[0]) is None  # a local plan has no duties: its rank checks everything it reads


@pytest.mark.parametrize("block_bytes", [8, 7 * 8 * 2 + 3, 1 << 20])
def test_block_reads_copy_any_box_through_small_blocks(tmp_path, block_bytes, monkeypatch):
    monkeypatch.setattr(block_reads, "PIECE_BYTES", 24)  # several checked pieces per block
    chunk = torch.randn(13, 7, dtype=torch.float64)
    raw = chunk.numpy().tobytes()
    path = tmp_path / "data.bin"
    path.write_bytes(b"hdr.." + raw)
    item = ReadItem(LoadItemType.TENSOR, MetadataIndex("w", (0, 0)), (0, 0), MetadataIndex("w", (0, 0)), (2, 1), (9, 5))
    fd = os.open(path, os.O_RDONLY)
    reads = BlockReads(block_bytes)
    try:
        dest = torch.zeros(5, 9, dtype=torch.float64).t()  # strided destination
        assert reads.read_box(fd, 5, (13, 7), item, dest, torch.float64, str(path)) == zlib.crc32(raw)
        assert torch.equal(dest, chunk[2:11, 1:6])
        whole = bytearray(len(raw))
        assert reads.read_into(fd, whole, 5, str(path)) == zlib.crc32(raw)
        assert bytes(whole) == raw
        scalar = torch.zeros((), dtype=torch.float64)
        one = ReadItem(LoadItemType.TENSOR, MetadataIndex("s"), (), MetadataIndex("s"), (), ())
        assert reads.read_box(fd, 5, (), one, scalar, torch.float64, str(path)) == zlib.crc32(raw[:8])
        assert scalar.item() == chunk[0, 0].item()
        rows = torch.zeros(9, 5, dtype=torch.float64)
        with counting_reads() as read:
            reads.read_rows(fd, 5, (13, 7), item, rows, torch.float64, str(path))
        assert torch.equal(rows, chunk[2:11, 1:6]) and sum(read) == 9 * 7 * 8  # rows 2..10 only
    finally:
        reads.close()
        os.close(fd)
