"""CPUOffloadPolicy on 2 gloo ranks: the offload transfers happen, and training stays exact.

On a CPU-only machine the compute device and the offload device are the same, so offloading
changes no value and no device: a parity test alone passes with offloading removed. What does
differ is the transfer of each reduced gradient to the offload device, which the offload path
must make and the plain path must not. The spy below records it: the outputs of the
reduce-scatters (``dist.reduce_scatter_single``, looked up at call time by
``collectives.reduce_scatter``) and every ``Tensor.to`` that names a device. A run without the
policy is the control that shows the spy tells the two apart.

The host-to-device copy of each shard before its all-gather is recorded too, but on CPU the plain
path makes the same call (the shard is copied to the compute device, which is its own), so that
check holds with or without offloading; see the gap noted in tools/CONFORMANCE.md.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Set

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import hyper_parallel as hp
from tests.fully_shard._helpers import (TOL, full_params, global_batch, lm_loss, max_diff, shard_layers_and_root,
                                        tiny_llama, train)
from tests.multirank import run_on_ranks

STEPS = 2


def _target_device(args: tuple, kwargs: Dict[str, Any]) -> Optional[torch.device]:
    """The device a ``Tensor.to(...)`` call names, if any (``to(dtype)`` names none)."""
    target = kwargs.get("device", args[0] if args else None)
    if isinstance(target, torch.Tensor):
        return target.device
    if isinstance(target, (str, torch.device)):
        return torch.device(target)
    return None


class _TransferSpy:
    """Records, per step, the reduce-scatter outputs, the all-gather inputs and the device
    transfers (``Tensor.to(device)`` of a plain tensor: source pointer, result pointer, device)."""

    def __init__(self) -> None:
        self.reduced: List[int] = []
        self.gather_inputs: List[int] = []
        self.transfers: List[tuple] = []

    def __enter__(self) -> "_TransferSpy":
        self._rs, self._ag = dist.reduce_scatter_single, dist.all_gather_single
        spy = self

        def reduce_scatter_single(output, input, *args, **kwargs):
            spy.reduced.append(output.data_ptr())
            return spy._rs(output, input, *args, **kwargs)

        def all_gather_single(output, input, *args, **kwargs):
            spy.gather_inputs.append(input.data_ptr())
            return spy._ag(output, input, *args, **kwargs)

        original_to = torch._C.TensorBase.to

        def to(tensor, *args, **kwargs):
            result = original_to(tensor, *args, **kwargs)
            device = _target_device(args, kwargs)
            if device is not None and type(tensor) is torch.Tensor:
                spy.transfers.append((tensor.data_ptr(), result.data_ptr(), device))
            return result

        dist.reduce_scatter_single, dist.all_gather_single = reduce_scatter_single, all_gather_single
        torch.Tensor.to = to
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.reduce_scatter_single, dist.all_gather_single = self._rs, self._ag
        del torch.Tensor.to  # back to TensorBase.to

    def clear(self) -> None:
        self.reduced, self.gather_inputs, self.transfers = [], [], []

    def reduced_grads_moved(self, device: torch.device) -> int:
        """How many reduce-scatter outputs were transferred to ``device``."""
        reduced = set(self.reduced)
        return sum(src in reduced and dev == device for src, _, dev in self.transfers)

    def gathers_fed_by_transfer(self, shard_storages: Set[int], device: torch.device) -> int:
        """How many all-gather inputs are the result of a transfer to ``device`` of a tensor
        living in the sharded parameters' storage."""
        fed = {dst for src, dst, dev in self.transfers if src in shard_storages and dev == device}
        return sum(ptr in fed for ptr in self.gather_inputs)


def _offload_run(offload: bool) -> Dict[str, Any]:
    """Train a float64 tiny Llama (one group per layer plus the root) for STEPS steps on this
    rank's half of each global batch; record the transfers of every step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    policy = hp.CPUOffloadPolicy(pin_memory=False) if offload else hp.OffloadPolicy()
    torch.manual_seed(0)
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    shard_layers_and_root(model, offload_policy=policy)
    batches = [global_batch(step) for step in range(STEPS)]
    train(reference, batches)

    offload_device = torch.device("cpu")
    compute_device = hp.get_platform().current_device()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-8, weight_decay=0.1)
    steps = []
    with _TransferSpy() as spy:
        for batch in batches:
            spy.clear()
            lm_loss(model, batch.chunk(world)[rank]).backward()
            # Read after the step: the first forward's lazy init may rebind the shards.
            shard_storages = {p.to_local().untyped_storage().data_ptr() for p in model.parameters()}
            steps.append({
                "reduce_scatters": len(spy.reduced),
                "grads_to_offload": spy.reduced_grads_moved(offload_device),
                "all_gathers": len(spy.gather_inputs),
                "gathers_from_transfer": spy.gathers_fed_by_transfer(shard_storages, compute_device),
                "grad_devices": sorted({p.grad.to_local().device.type for p in model.parameters()}),
            })
            opt.step()
            opt.zero_grad()
    assert all(isinstance(p, DTensor) for p in model.parameters())
    return {"steps": steps, "diff": max_diff(full_params(model), full_params(reference)),
            "param_devices": sorted({p.to_local().device.type for p in model.parameters()})}


def test_cpu_offload_moves_every_reduced_grad_and_trains_exactly():
    for offload, plain in zip(run_on_ranks(2, _offload_run, True, timeout=240),
                              run_on_ranks(2, _offload_run, False, timeout=240)):
        assert offload["diff"] <= TOL and plain["diff"] <= TOL, (offload["diff"], plain["diff"])
        assert offload["param_devices"] == ["cpu"]
        for step, control in zip(offload["steps"], plain["steps"]):
            assert step["reduce_scatters"] == control["reduce_scatters"] > 0
            # Offload: every reduced gradient goes to the offload device; plain: none does.
            assert step["grads_to_offload"] == step["reduce_scatters"], step
            assert control["grads_to_offload"] == 0, control
            # Every all-gather reads a copy of the offloaded shard made on the compute device.
            assert step["gathers_from_transfer"] == step["all_gathers"] > 0, step
            assert step["grad_devices"] == ["cpu"]
