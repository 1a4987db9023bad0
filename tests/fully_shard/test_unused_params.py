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


class _Stacked(nn.Module):
    """Three fully_shard groups (``a``, ``b``, the root): ``b.second`` may be used on some ranks
    only, so the ranks must still issue the groups' reduce-scatters in the same order."""

    def __init__(self):
        super().__init__()
        self.inp, self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6), _Branchy()

    def forward(self, x: torch.Tensor, use_second: bool) -> torch.Tensor:
        return self.b(torch.tanh(self.a(self.inp(x))), use_second)


def _full_grads_or_none(model: nn.Module) -> Dict[str, Optional[torch.Tensor]]:
    return {name: None if p.grad is None else
            (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone())
            for name, p in model.named_parameters()}


def _case(second_used_on: tuple, mesh_shape: tuple, stacked: bool = False) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = (_Stacked() if stacked else _Branchy()).to(torch.float64)
    model = copy.deepcopy(reference)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", mesh_shape)
    if stacked:
        hp.fully_shard(model.a, mesh=mesh)
        hp.fully_shard(model.b, mesh=mesh)
    hp.fully_shard(model, mesh=mesh)
    inputs = torch.randn(world, 3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    model(inputs[rank], rank in second_used_on).backward()
    # Reference: the mean over ranks of each rank's loss, in one process.
    (sum(reference(inputs[r], r in second_used_on) for r in range(world)) / world).backward()
    ours, expected = _full_grads_or_none(model), _full_grads_or_none(reference)
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
            "used on rank 0 only": _case((0,), (2,)),
            "three groups, unused everywhere": _case((), (2,), stacked=True),
            "three groups, used on rank 0 only": _case((0,), (2,), stacked=True),
            "three groups, used on rank 1 only": _case((1,), (2,), stacked=True)}


def _hsdp_cases() -> dict:
    return {"HSDP unused everywhere": _case((), (2, 2)),
            "HSDP used on rank 3 only": _case((3,), (2, 2))}


def _check_diffs(results) -> None:
    for result in results:
        for case, diffs in result.items():
            for name, diff in diffs.items():
                if "second." in name and case.endswith("everywhere"):
                    assert diff == (True, True), f"{case}: {name} grad is not None"
                else:
                    assert isinstance(diff, float) and diff < 1e-12, f"{case}: {name}: {diff}"


def test_unused_parameters_keep_none_grads_and_partly_used_ones_agree():
    _check_diffs(run_on_ranks(2, _all_cases, timeout=120))


def test_hsdp_unused_parameters():
    _check_diffs(run_on_ranks(4, _hsdp_cases, timeout=180))


class _TiedUnusedOwner(nn.Module):
    """``head`` shares ``emb``'s weight (two groups: ``head`` borrows it). With ``use_owner``
    False the embedding's output does not reach the loss: only the borrower's backward runs."""

    def __init__(self):
        super().__init__()
        self.emb, self.proj = nn.Embedding(5, 6), nn.Linear(6, 6)
        self.head = nn.Linear(6, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor, x: torch.Tensor, use_owner: bool) -> torch.Tensor:
        h = self.proj(x)
        if use_owner:
            h = h + self.emb(tokens).sum(1)
        else:
            self.emb(tokens)  # runs, but does not reach the loss
        return self.head(torch.tanh(h)).square().sum()


def _tied_owner_case(use_owner: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _TiedUnusedOwner().to(torch.float64)
    model = copy.deepcopy(reference)
    model.head.weight = model.emb.weight
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    hp.fully_shard(model.emb, mesh=mesh)
    hp.fully_shard(model.head, mesh=mesh)
    hp.fully_shard(model, mesh=mesh)
    gen = torch.Generator().manual_seed(1)
    tokens, x = torch.randint(0, 5, (world, 3, 2), generator=gen), torch.randn(world, 3, 6, dtype=torch.float64,
                                                                                 generator=gen)
    model(tokens[rank], x[rank], use_owner).backward()
    (sum(reference(tokens[r], x[r], use_owner) for r in range(world)) / world).backward()
    ours, expected = _full_grads_or_none(model), _full_grads_or_none(reference)
    return {name: (ours[name] - expected[name]).abs().max().item() for name in expected}


def _tied_cases() -> dict:
    return {"tied, owner used": _tied_owner_case(True), "tied, owner unused": _tied_owner_case(False)}


def test_shared_weight_reduced_once_every_module_using_it_is_done():
    for result in run_on_ranks(2, _tied_cases, timeout=120):
        for case, diffs in result.items():
            assert all(d < 1e-12 for d in diffs.values()), (case, diffs)
