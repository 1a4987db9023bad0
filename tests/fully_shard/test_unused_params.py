"""A trainable parameter no rank computed a gradient for keeps ``grad = None`` (as with torch
FSDP2, so the optimizer skips it); one that only some ranks used gets the reduced gradient on
every rank."""

from __future__ import annotations

import copy
from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import hyper_parallel as hp
from tests.multirank import run_on_ranks


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, use_second: bool) -> torch.Tensor:
        y = torch.tanh(self.first(x))
        return (self.second(y) if use_second else y).square().sum()


def _grads(model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    return {name: None if p.grad is None else
            (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone())
            for name, p in model.named_parameters()}


def _case(second_used_on: tuple, mesh_shape: tuple) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _Branchy().to(torch.float64)
    model = copy.deepcopy(reference)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", mesh_shape)
    hp.fully_shard(model, mesh=mesh)
    inputs = torch.randn(world, 3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    model(inputs[rank], rank in second_used_on).backward()
    # Reference: the mean over ranks of each rank's loss, in one process.
    (sum(reference(inputs[r], r in second_used_on) for r in range(world)) / world).backward()
    ours, expected = _grads(model), _grads(reference)
    diffs = {}
    for name in expected:
        if expected[name] is None or ours[name] is None:
            diffs[name] = (ours[name] is None, expected[name] is None)
        else:
            diffs[name] = (ours[name] - expected[name]).abs().max().item()
    torch.optim.AdamW(model.parameters(), lr=0.1).step()  # must skip the None grads
    return diffs


def _all_cases() -> dict:
    return {"unused everywhere": _case((), (2,)),
            "used on rank 0 only": _case((0,), (2,))}


def _hsdp_cases() -> dict:
    return {"HSDP unused everywhere": _case((), (2, 2)),
            "HSDP used on rank 3 only": _case((3,), (2, 2))}


def _check(results) -> None:
    for result in results:
        for case, diffs in result.items():
            for name, diff in diffs.items():
                if name.startswith("second.") and case.endswith("everywhere"):
                    assert diff == (True, True), f"{case}: {name} grad is not None"
                else:
                    assert isinstance(diff, float) and diff < 1e-12, f"{case}: {name}: {diff}"


def test_unused_parameters_keep_none_grads_and_partly_used_ones_agree():
    _check(run_on_ranks(2, _all_cases, timeout=120))


def test_hsdp_unused_parameters():
    _check(run_on_ranks(4, _hsdp_cases, timeout=180))
