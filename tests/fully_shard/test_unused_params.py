"""A trainable parameter no rank computed a gradient for keeps ``grad = None`` (as with torch
FSDP2, so the optimizer skips it); one that only some ranks used gets the reduced gradient on
every rank."""

from __future__ import annotations

import copy
from typing import Dict, Optional

import pytest
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


# case -> (ranks whose loss uses the second branch, mesh shape, three groups)
CASES = {"unused everywhere": ((), (2,), False),
         "used on rank 0 only": ((0,), (2,), False),
         "three groups, unused everywhere": ((), (2,), True),
         "three groups, used on rank 0 only": ((0,), (2,), True),
         "three groups, used on rank 1 only": ((1,), (2,), True),
         "HSDP unused everywhere": ((), (2, 2), False),
         "HSDP used on rank 3 only": ((3,), (2, 2), False)}


def _named_case(case: str) -> dict:
    second_used_on, mesh_shape, stacked = CASES[case]
    return {case: _case(second_used_on, mesh_shape, stacked=stacked)}


def _ids(cases):
    return [c.replace(", ", "-").replace(" ", "_") for c in cases]


def _check_diffs(results) -> None:
    for result in results:
        for case, diffs in result.items():
            for name, diff in diffs.items():
                if "second." in name and case.endswith("everywhere"):
                    assert diff == (True, True), f"{case}: {name} grad is not None"
                else:
                    assert isinstance(diff, float) and diff < 1e-12, f"{case}: {name}: {diff}"


_FSDP_CASES = [c for c in CASES if not c.startswith("HSDP")]
_HSDP_CASES = [c for c in CASES if c.startswith("HSDP")]


@pytest.mark.parametrize("case", _FSDP_CASES, ids=_ids(_FSDP_CASES))
def test_unused_parameters_keep_none_grads_and_partly_used_ones_agree(case):
    _check_diffs(run_on_ranks(2, _named_case, case, timeout=120))


@pytest.mark.parametrize("case", _HSDP_CASES, ids=_ids(_HSDP_CASES))
def test_hsdp_unused_parameters(case):
    _check_diffs(run_on_ranks(4, _named_case, case, timeout=180))


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


def _tied_case(use_owner: bool) -> dict:
    return {f"tied, owner {'used' if use_owner else 'unused'}": _tied_owner_case(use_owner)}


@pytest.mark.parametrize("use_owner", [True, False], ids=["owner_used", "owner_unused"])
def test_shared_weight_reduced_once_every_module_using_it_is_done(use_owner):
    for result in run_on_ranks(2, _tied_case, use_owner, timeout=120):
        for case, diffs in result.items():
            assert all(d < 1e-12 for d in diffs.values()), (case, diffs)
