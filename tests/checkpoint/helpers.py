"""Shared state builders for checkpoint tests: one seed -> the same full tensors on every rank."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from hyper_parallel import checkpoint as hdcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

# Odd sizes on purpose: nothing divides evenly by 2 or 4 on the sharded dims.
PARAM_SHAPES = {"embed.weight": (11, 6), "layers.0.w": (7, 5), "layers.0.b": (5,), "layers.1.w": (3, 9),
                "norm.weight": (6,)}


def full_state(seed: int = 0) -> Dict[str, Any]:
    """Model params + AdamW-like optimizer state + plain values, as full plain tensors."""
    g = torch.Generator().manual_seed(seed)
    model = {k: torch.randn(s, generator=g) for k, s in PARAM_SHAPES.items()}
    model["embed.weight"] = model["embed.weight"].to(torch.bfloat16)
    state = {k: {"exp_avg": torch.randn(s, generator=g), "exp_avg_sq": torch.rand(s, generator=g),
                 "step": torch.tensor(float(seed + 5))} for k, s in PARAM_SHAPES.items()}
    return {
        "model": model,
        "optim": {"state": state, "param_groups": [{"lr": 1e-3 * (seed + 1), "betas": (0.9, 0.95),
                                                    "params": sorted(PARAM_SHAPES)}]},
        "train": {"step": 10 + seed, "tokens_seen": 12345, "name": "run-a"},
    }


def blank_state() -> Dict[str, Any]:
    """A state with the same structure and different values (what a load fills in)."""
    state = full_state(seed=99)
    for tree in (state["model"], *state["optim"]["state"].values()):
        for k, v in tree.items():
            tree[k] = torch.zeros_like(v)
    return state


def mesh_and_placements(layout: str):
    """(mesh, placements for a tensor of a given ndim) for a named layout."""
    world = dist.get_world_size()
    if layout in ("hsdp", "2d", "shard00"):
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        if layout == "2d":  # both mesh dims shard, different tensor dims
            return mesh, lambda ndim: (Shard(0), Shard(ndim - 1))
        if layout == "shard00":  # both mesh dims shard tensor dim 0
            return mesh, lambda ndim: (Shard(0), Shard(0))
        return mesh, lambda ndim: (Replicate(), Shard(0))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    if layout == "fsdp":
        return mesh, lambda ndim: (Shard(0),)
    if layout == "shard1":
        return mesh, lambda ndim: (Shard(ndim - 1),)
    if layout == "replicate":
        return mesh, lambda ndim: (Replicate(),)
    raise ValueError(layout)


def distribute_state(state: Dict[str, Any], layout: Optional[str]) -> Dict[str, Any]:
    """Turn params and exp_avg* into DTensors of ``layout`` (None: keep plain); ``step`` stays plain."""
    if layout is None:
        return state
    mesh, placements = mesh_and_placements(layout)

    def dt(t: torch.Tensor) -> DTensor:
        return distribute_tensor(t, mesh, placements(t.dim()))

    state["model"] = {k: dt(v) for k, v in state["model"].items()}
    for tree in state["optim"]["state"].values():
        tree["exp_avg"], tree["exp_avg_sq"] = dt(tree["exp_avg"]), dt(tree["exp_avg_sq"])
    return state


def assert_state_equal(actual: Dict[str, Any], expected: Dict[str, Any], path: str = "") -> None:
    """Every tensor (DTensors via full_tensor) and value equal, with matching types."""
    assert type(actual) is type(expected) or isinstance(actual, torch.Tensor), (path, type(actual))
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), (path, actual.keys(), expected.keys())
        for k in expected:
            assert_state_equal(actual[k], expected[k], f"{path}.{k}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), path
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_state_equal(a, e, f"{path}.{i}")
    elif isinstance(expected, torch.Tensor):
        full = actual.full_tensor() if isinstance(actual, DTensor) else actual
        assert full.dtype == expected.dtype and torch.equal(full, expected), f"{path} differs"
    else:
        assert actual == expected, (path, actual, expected)


def state_nbytes(state: Dict[str, Any]) -> int:
    total = 0
    for tree in (state["model"], *state["optim"]["state"].values()):
        total += sum(v.numel() * v.element_size() for v in tree.values())
    return total


def save_layout(path: str, layout: Optional[str], seed: int = 0, **kwargs) -> None:
    hdcp.save(distribute_state(full_state(seed), layout), checkpoint_id=path, **kwargs)


def load_and_check(path: str, layouts: Sequence[Optional[str]], seed: int = 0, **kwargs) -> bool:
    """Load ``path`` into each layout in turn and compare with the full state of ``seed``."""
    for layout in layouts:
        target = distribute_state(blank_state(), layout)
        hdcp.load(target, checkpoint_id=path, **kwargs)
        assert_state_equal(target, full_state(seed))
    return True


class FailingWriter(hdcp.FileSystemWriter):
    """Fails on rank 1 while writing (a full disk, say)."""

    def execute_write(self, plan, planner):
        if self.rank == 1:
            raise OSError("disk full (simulated)")
        return super().execute_write(plan, planner)


@contextlib.contextmanager
def counting_reads():
    """Yields a list that collects the byte count of every ``os.preadv`` (how readers read)."""
    real_preadv = os.preadv
    counts: List[int] = []

    def preadv(fd, buffers, offset):
        n = real_preadv(fd, buffers, offset)
        counts.append(n)
        return n

    os.preadv = preadv
    try:
        yield counts
    finally:
        os.preadv = real_preadv
