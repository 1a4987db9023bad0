"""Shared state builders for checkpoint tests: one seed -> the same full tensors on every rank;
tiny Llama models sharded by hand or by fully_shard; the refusal check of a damaged checkpoint."""

from __future__ import annotations

import contextlib
import math
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hyper_parallel as hp
from hyper_parallel import checkpoint as hdcp
from hyper_parallel._torch_compat import init_fake_process_group
from hyper_parallel.core.distributed_checkpoint.cli import main as cli_main
from hyper_parallel.core.distributed_checkpoint.format.metadata import Metadata, MetadataIndex
from hyper_parallel.core.distributed_checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from hyper_parallel.models import build_llama
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


def app_state(model: nn.Module, optim: torch.optim.Optimizer) -> Dict[str, Any]:
    """What a training loop checkpoints: the model and its optimizer, resolved on save/load."""
    return {"model": hdcp.ModelState(model), "optim": hdcp.OptimizerState(model, optim)}


def local_tensor_clones(state: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Clones of every tensor (DTensor: local shard) of the resolved ``app_state``, by flat key."""
    flat = hdcp.flatten_state_dict({k: v.state_dict() for k, v in state.items()})[0]
    return {k: (v.to_local() if isinstance(v, DTensor) else v).clone()
            for k, v in flat.items() if isinstance(v, torch.Tensor)}


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


class FullDiskWriter(hdcp.FileSystemWriter):
    """Fails on every rank while writing."""

    def execute_write(self, plan, planner):
        raise OSError("disk full (simulated)")


class FailingStagingPlanner(hdcp.StandardSavePlanner):
    """Fails while staging the chunk of ``small.b5``."""

    def get_data(self, item):
        if item.index.fqn == "small.b5":
            raise RuntimeError("chunk source broke (simulated)")
        return super().get_data(item)


# ------------------------------------------------------------- meta DTensors on torch's fake process group

# (mesh shape, placements) per layout; the state below is saved with one and loaded with another.
META_LAYOUTS = {
    "fsdp": ((6,), (Shard(0),)),
    "fsdp_large": ((11,), (Shard(0),)),
    "hsdp": ((2, 3), (Replicate(), Shard(0))),
    "shard1": ((4,), (Shard(1),)),
    "2d": ((3, 2), (Shard(0), Shard(1))),
    "2d_swapped": ((2, 5), (Shard(1), Shard(0))),
    "replicated": ((3,), (Replicate(),)),
}
META_SHAPES = {"w": (13, 10), "v": (7, 3), "odd": (29, 4), "long": (5, 31)}


def meta_state(layout: str, rank: int):
    """Meta DTensors of every key of META_SHAPES as ``rank`` holds them under ``layout``."""
    mesh_shape, placements = META_LAYOUTS[layout]
    world = math.prod(mesh_shape)
    if dist.is_initialized():
        dist.destroy_process_group()
    init_fake_process_group(rank, world)
    mesh = init_device_mesh("cpu", mesh_shape)
    state = {}
    for key, shape in META_SHAPES.items():
        full = torch.empty(shape, dtype=torch.float64, device="meta")
        state[key] = DTensor.from_local(full, mesh, [Replicate()] * len(mesh_shape), run_check=False
                                        ).redistribute(mesh, placements)
    return state


# ---------------------------------------------------------------------------- bounce reads

BOX_ROWS, BOX_COLS = 4, 32  # one box: 4 x 32 float64 = 1024 bytes = one slab


class AppliedBoxes(LoadPlanner):
    """Records the boxes BounceReads applies (the only planner call it makes)."""

    def __init__(self) -> None:
        self.applied: List[str] = []
        self._lock = threading.Lock()

    def apply_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        with self._lock:
            self.applied.append(read_item.storage_index.fqn)

    def configure_planner(self, state_dict: Dict[str, Any], metadata: Metadata, **kwargs: Any) -> None:
        raise NotImplementedError

    def build_local_plan(self) -> LoadPlan:
        raise NotImplementedError

    def build_global_plan(self, all_plans: List[LoadPlan]) -> List[LoadPlan]:
        raise NotImplementedError

    def finalize_plan(self, plan: LoadPlan) -> LoadPlan:
        raise NotImplementedError

    def acquire_tensor(self, read_item: ReadItem) -> torch.Tensor:
        raise NotImplementedError

    def apply_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise NotImplementedError


def box_read(name: str) -> ReadItem:
    """The read of a whole BOX_ROWS x BOX_COLS tensor ``name``."""
    index = MetadataIndex(name, (0, 0))
    return ReadItem(LoadItemType.TENSOR, index, (0, 0), index, (0, 0), (BOX_ROWS, BOX_COLS))


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


def message_or(done: str, call: Callable[[], Any],
               errors: Tuple[Type[BaseException], ...] = (hdcp.CheckpointError,)) -> str:
    """The message of the error (one of ``errors``) ``call()`` raises, else ``done``."""
    try:
        call()
    except errors as exc:
        return str(exc)
    return done


def refused(path: str, match: str) -> None:
    """load (with and without verify) and the CLI verify all refuse ``path``."""
    for verify in (True, False):
        with pytest.raises(hdcp.CheckpointError, match=match):
            hdcp.load(blank_state(), checkpoint_id=path, no_dist=True, verify=verify)
    with pytest.raises(hdcp.CheckpointError, match=match):
        hdcp.verify_checkpoint(path)
    assert cli_main(["verify", path]) == 1


# ---------------------------------------------------------------------------- tiny Llama models

def make_llama(seed: int = 0, **overrides) -> nn.Module:
    torch.manual_seed(seed)
    model = build_llama("llama_debug", **overrides)
    model.init_weights(seed)
    return model


def shard_params(model: nn.Module, mesh, placements_fn) -> nn.Module:
    """Replace every parameter by a DTensor with ``placements_fn(name, param)`` (ties kept)."""
    done = {}
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param not in done:
                fqn = f"{module_name}.{name}".lstrip(".")
                done[param] = nn.Parameter(distribute_tensor(param.detach(), mesh, placements_fn(fqn, param)))
            setattr(module, name, done[param])
    return model


def seeded_grads_step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    """One optimizer step with seeded gradients that do not depend on the layout."""
    gen = torch.Generator().manual_seed(seed)
    for _, param in sorted(dict(model.named_parameters()).items()):
        grad = torch.randn(param.shape, generator=gen)
        if isinstance(param, DTensor):
            grad = distribute_tensor(grad, param.device_mesh, param.placements, src_data_rank=None)
        param.grad = grad
    optim.step()


def full_model_state_dict(model: nn.Module) -> dict:
    """``get_model_state_dict(model)`` with every DTensor gathered (a collective)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v.clone()
            for k, v in hdcp.get_model_state_dict(model).items()}


def save_fully_sharded_llama(path: str, seed: int) -> bool:
    """Save a fully_shard-ed Llama of ``seed`` with a fresh AdamW and a step (run on every rank)."""
    model = make_llama(seed=seed)
    for layer in model.layers.values():
        hp.fully_shard(layer)
    hp.fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    hdcp.save({"model": hdcp.ModelState(model).state_dict(), "optim": hdcp.OptimizerState(model, optim).state_dict(),
               "step": 3}, checkpoint_id=path)
    return True
