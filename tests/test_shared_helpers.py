"""The package-wide helpers: layout (this rank's part of a full tensor, checked
against torch's distribute_tensor), rank and world size, byte formatting, refused files."""

import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from hyper_parallel._torch_compat import init_fake_process_group
from hyper_parallel.checkpoint import CheckpointError
from hyper_parallel.core.distributed_checkpoint import _fileio
from hyper_parallel.core.layout import local_box, local_part
from hyper_parallel.utils import fileio
from hyper_parallel.utils.ranks import rank_and_world
from hyper_parallel.utils.units import format_bytes


@pytest.fixture
def rank_3_of_4():
    assert not dist.is_initialized(), "a test left a process group behind"
    init_fake_process_group(3, 4)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("mesh_shape,placements", [
    ((4,), (Shard(0),)), ((4,), (Shard(1),)), ((4,), (Replicate(),)),
    ((2, 2), (Shard(0), Shard(1))), ((2, 2), (Replicate(), Shard(0))), ((2, 2), (Shard(1), Shard(1))),
])
def test_local_part_is_distribute_tensors_local_shard(rank_3_of_4, mesh_shape, placements):
    mesh = init_device_mesh("cpu", mesh_shape)
    full = torch.arange(7 * 10, dtype=torch.float32).reshape(7, 10)  # 7 rows: uneven over 2 and 4
    like = distribute_tensor(torch.empty(7, 10), mesh, placements, src_data_rank=None)
    expected = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
    assert torch.equal(local_part(full, like), expected)
    sizes, _ = local_box(like)
    assert sizes == tuple(like.to_local().shape)


def test_rank_and_world_with_and_without_a_process_group(rank_3_of_4):
    assert rank_and_world() == (3, 4)
    assert rank_and_world(use_dist=False) == (0, 1)
    dist.destroy_process_group()
    assert rank_and_world() == (0, 1)
    init_fake_process_group(3, 4)  # for the fixture's teardown


def test_format_bytes_settings():
    assert [format_bytes(n) for n in (12, 1024, 341 << 20, 5 << 30, 3 << 40)] == \
        ["12B", "1KiB", "341MiB", "5GiB", "3.0TiB"]
    assert [format_bytes(n, digits=2, sep=" ") for n in (12, 64 << 10, 1536 << 20)] == \
        ["12 B", "64.00 KiB", "1.50 GiB"]


def test_a_refused_file_is_neutral_in_utils_and_a_checkpoint_error_in_the_checkpoint(tmp_path):
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    with pytest.raises(fileio.RefusedFileError, match="pipe is a FIFO, not a regular file") as neutral:
        fileio.open_regular(fifo)
    assert not isinstance(neutral.value, CheckpointError)
    with pytest.raises(CheckpointError, match="pipe is a FIFO, not a regular file"):
        _fileio.open_regular(fifo)
    with pytest.raises(CheckpointError, match="more than the 1 bytes"):
        (tmp_path / "big").write_bytes(b"ab")
        _fileio.read_regular_file(str(tmp_path / "big"), 1, "a test file")
