"""Loads broadcast a replicated shard from the replica that read it; the device the broadcast
runs on is the one the group's backends serve (``Platform.collective_device``).

A host tensor (CPU-offloaded parameters under HSDP, or TP-replicated ones) over an NCCL / HCCL
group, which serves only the accelerator, is broadcast through a copy on the rank's device;
over gloo, or a group with a CPU backend too, it is broadcast where it lives.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import hyper_parallel as hp
from hyper_parallel import checkpoint as hdcp
from hyper_parallel.platform import Platform, get_platform
from tests.fully_shard._helpers import shard_layers_and_root, tiny_llama
from tests.multirank import run_on_ranks

CPU, GPU1 = torch.device("cpu"), torch.device("cuda", 1)


class _FakeCuda(Platform):
    """A CUDA platform on its second device (nothing here touches the CUDA runtime)."""

    def __init__(self) -> None:
        super().__init__(device_type="cuda", backend="nccl")

    def current_device(self) -> torch.device:
        return GPU1


@pytest.mark.parametrize("config, device, expected", [
    ("cuda:nccl", CPU, GPU1),  # a host tensor over NCCL alone: a copy on this rank's device
    ("cuda:nccl", GPU1, GPU1),
    ("cpu:gloo,cuda:nccl", CPU, CPU),  # gloo serves the host tensor where it is
    ("cpu:gloo,cuda:gloo", CPU, CPU),
])
def test_collectives_run_where_a_backend_of_the_group_serves_them(config, device, expected):
    with mock.patch.object(dist, "get_backend_config", return_value=config) as asked:
        assert _FakeCuda().collective_device(device, group=None) == expected
    asked.assert_called_once_with(None)


def test_a_group_serving_neither_device_is_refused():
    with mock.patch.object(dist, "get_backend_config", return_value="npu:hccl"), \
            pytest.raises(ValueError, match="cannot take part in a collective over a process group whose "
                                            "backends are 'npu:hccl'"):
        _FakeCuda().collective_device(CPU, group=None)


def _hsdp_offloaded(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return shard_layers_and_root(tiny_llama(), mesh=mesh, offload_policy=hp.CPUOffloadPolicy())


def _load_hsdp_offloaded(path: str):
    """Save an HSDP model with CPU offload, load it into another one; the replicated shards
    reach the second replica by broadcast, each on the device ``collective_device`` chose."""
    source = _hsdp_offloaded(seed=0)
    hdcp.save({"model": hdcp.ModelState(source).state_dict()}, checkpoint_id=path)
    target = _hsdp_offloaded(seed=1)
    broadcasts, chosen = [], []
    broadcast, choose = dist.broadcast, Platform.collective_device

    def recording_broadcast(tensor, *args, **kwargs):
        broadcasts.append(tensor.device)
        return broadcast(tensor, *args, **kwargs)

    def recording_choice(platform, device, group):
        chosen.append(choose(platform, device, group))
        return chosen[-1]

    with mock.patch.object(dist, "broadcast", recording_broadcast), \
            mock.patch.object(Platform, "collective_device", recording_choice):
        state = {"model": hdcp.ModelState(target)}
        hdcp.load(state, checkpoint_id=path)
    local_devices = {p.to_local().device for p in target.parameters() if isinstance(p, DTensor)}
    exact = all(torch.equal(a.full_tensor(), b.full_tensor())
                for a, b in zip(source.state_dict().values(), target.state_dict().values()))
    return exact, broadcasts, chosen, local_devices, get_platform().current_device()


def test_hsdp_with_cpu_offload_loads_exactly_through_replica_broadcasts(tmp_path):
    for exact, broadcasts, chosen, local_devices, device in run_on_ranks(
            4, _load_hsdp_offloaded, str(tmp_path / "ckpt"), timeout=120):
        assert exact
        assert local_devices == {CPU}  # offloaded
        # every parameter is replicated over the replicate dim: each was broadcast once, on the
        # device the platform chose for the group (gloo: where it lives)
        assert broadcasts and broadcasts == chosen == [device] * len(broadcasts), (broadcasts, chosen)
