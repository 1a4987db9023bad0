import pytest
import torch.distributed as dist

from hyper_parallel.platform import get_platform, reset_platform
from tests.multirank import run_on_ranks


def test_cpu_platform_uses_gloo(monkeypatch):
    monkeypatch.setenv("HYPER_PARALLEL_DEVICE", "cpu")
    reset_platform()
    p = get_platform()
    assert (p.device_type, p.backend, str(p.current_device())) == ("cpu", "gloo", "cpu")
    assert p.peak_memory_bytes() > 0
    reset_platform()


def test_unknown_device_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HYPER_PARALLEL_DEVICE", "tpu")
    reset_platform()
    with pytest.raises(ValueError, match="HYPER_PARALLEL_DEVICE"):
        get_platform()
    reset_platform()


def _rank_and_world():
    p = get_platform()
    return p.rank, p.world_size, p.backend, dist.get_backend()


def test_rank_and_world_size_inside_a_group():
    assert run_on_ranks(2, _rank_and_world) == [(0, 2, "gloo", "gloo"), (1, 2, "gloo", "gloo")]
