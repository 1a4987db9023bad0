"""``hp.patch_torch_fsdp()``: a program written against torch's FSDP2 names (here a
torchtitan-style parallelize / train / DCP save / load loop that imports everything from torch)
runs on hyper_parallel's fully_shard and gives torch's losses; the patch undoes cleanly."""

from __future__ import annotations

import importlib
from typing import List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel._torch_compat import fsdp2_export_modules
from hyper_parallel.core.fully_shard.torch_dropin import REPLACEMENTS
from tests.fully_shard._helpers import global_batch, tiny_llama
from tests.multirank import run_on_ranks


# -- the client program: torchtitan's style, torch's names only --------------------------------
def _parallelize(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float64)
    last = len(model.layers) - 1
    for layer_id, block in model.layers.items():
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=int(layer_id) < last)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    # torchtitan's disable_fsdp_gradient_division: the loss is divided by the global token count.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
    return model


def _train_steps(model, optimizer, steps: range) -> List[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        tokens = global_batch(step).chunk(world)[rank]
        logits = model(tokens[:, :-1])
        global_tokens = tokens[:, 1:].numel() * world
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum") / global_tokens
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def _build():
    torch.manual_seed(0)
    model = _parallelize(tiny_llama())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _titan_loop(checkpoint_dir: str) -> List[float]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    model, optimizer = _build()
    losses = _train_steps(model, optimizer, range(2))
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=checkpoint_dir)
    model, optimizer = _build()  # a fresh job resuming
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    return losses + _train_steps(model, optimizer, range(2, 4))


# -- the runs -----------------------------------------------------------------------------------
def _patched_and_torch(tmp: str):
    from torch.distributed.fsdp import FSDPModule

    torch_losses = _titan_loop(f"{tmp}/torch")
    with hp.patch_torch_fsdp():
        ours_losses = _titan_loop(f"{tmp}/ours")
        model, _ = _build()
        wrapped_by_ours = isinstance(model, hp.FSDPModule) and isinstance(model, FSDPModule)
    return torch_losses, ours_losses, wrapped_by_ours


def test_torchtitan_style_loop_with_dcp_matches_torch(tmp_path):
    for torch_losses, ours, wrapped_by_ours in run_on_ranks(2, _patched_and_torch, str(tmp_path), timeout=240):
        assert wrapped_by_ours
        assert len(ours) == len(torch_losses) == 4
        assert max(abs(a - b) for a, b in zip(ours, torch_losses)) <= 1e-12, (ours, torch_losses)
        assert ours[3] < ours[0]  # it trained


def test_patch_replaces_every_export_and_undoes():
    originals = {(m.__name__, n): vars(m)[n] for m in fsdp2_export_modules() for n in REPLACEMENTS if n in vars(m)}
    from torch.distributed.fsdp._fully_shard import _fully_shard as torch_internals

    internals = dict(vars(torch_internals))
    with hp.patch_torch_fsdp() as patch:
        for module_name, name in originals:
            assert getattr(importlib.import_module(module_name), name) is REPLACEMENTS[name], (module_name, name)
        from torch.distributed.fsdp import fully_shard
        assert fully_shard is hp.fully_shard
        # torch's functions read these globals when they run: never patched
        assert all(vars(torch_internals)[name] is value for name, value in internals.items() if name in REPLACEMENTS)
    assert not patch.active
    for (module_name, name), value in originals.items():
        assert getattr(importlib.import_module(module_name), name) is value, (module_name, name)
    assert {"torch.distributed.fsdp", "torch.distributed._composable.fsdp"} <= {m for m, _ in originals}


def test_nested_patches_undone_in_any_order_restore_torch():
    from torch.distributed import fsdp

    torch_values = {name: getattr(fsdp, name) for name in REPLACEMENTS}
    first, second = hp.patch_torch_fsdp(), hp.patch_torch_fsdp()
    first.undo()  # in creation order: the second patch still holds
    assert second.active and not first.active
    assert all(getattr(fsdp, name) is ours for name, ours in REPLACEMENTS.items())
    second.undo()
    assert all(getattr(fsdp, name) is value for name, value in torch_values.items())
    with hp.patch_torch_fsdp(), hp.patch_torch_fsdp():  # and in reverse order
        assert fsdp.fully_shard is hp.fully_shard
    assert all(getattr(fsdp, name) is value for name, value in torch_values.items())


def test_patch_rebinds_torchs_names_a_module_imported_before_it_bound(monkeypatch):
    import sys
    import types

    from torch.distributed import fsdp

    torch_fully_shard, torch_policy = fsdp.fully_shard, fsdp.MixedPrecisionPolicy
    client = types.ModuleType("my_trainer")
    client.fully_shard = torch_fully_shard  # `from torch.distributed.fsdp import fully_shard` at its import
    client.MixedPrecisionPolicy = torch_policy
    client.torch_fully_shard = torch_fully_shard  # bound under another name on purpose: left alone
    monkeypatch.setitem(sys.modules, "my_trainer", client)
    with hp.patch_torch_fsdp():
        assert client.fully_shard is hp.fully_shard and client.MixedPrecisionPolicy is hp.MixedPrecisionPolicy
        assert client.torch_fully_shard is torch_fully_shard
    assert (client.fully_shard, client.MixedPrecisionPolicy) == (torch_fully_shard, torch_policy)
    assert fsdp.fully_shard is torch_fully_shard


def _torch_fully_shard_bound_before_the_patch():
    """A program bound torch's fully_shard, then patched: torch's still wraps and its recursive
    setters reach every module it wrapped; ours refuses a module torch's wrapped."""
    from torch.distributed.fsdp import fully_shard as bound_before

    torch.manual_seed(0)
    model = tiny_llama()
    with hp.patch_torch_fsdp():
        for block in model.layers.values():
            bound_before(block)
        bound_before(model)
        model.set_requires_gradient_sync(False)
        synced = [block._get_fsdp_state()._fsdp_param_group.reduce_grads for block in model.layers.values()]
        refusals = []
        for target in (tiny_llama(), model.layers["0"]):
            if target is not model.layers["0"]:
                bound_before(target.layers["0"])
            try:
                hp.fully_shard(target)
            except ValueError as err:
                refusals.append(str(err))
    return synced, refusals


def test_torchs_fully_shard_bound_before_the_patch_still_works():
    for synced, refusals in run_on_ranks(2, _torch_fully_shard_bound_before_the_patch, timeout=120):
        assert synced == [False, False], synced  # the setter reached torch's wrapped blocks
        assert len(refusals) == 2, refusals
        assert "cannot wrap submodule 'layers.0' (FSDPTransformerBlock): torch's fully_shard" in refusals[0]
        assert "cannot wrap this module (FSDPTransformerBlock): torch's fully_shard" in refusals[1]


# -- accelerate's FSDP2 plugin ------------------------------------------------------------------
def _accelerate_loop() -> List[float]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    threads = torch.get_num_threads()
    try:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
        # accelerate enables its FSDP plugin on accelerator devices only; the CPU run sets
        # what it would have decided there.
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        torch.manual_seed(0)
        model = tiny_llama()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        rank, world = dist.get_rank(), dist.get_world_size()
        losses = []
        for step in range(3):
            tokens = global_batch(step).chunk(world)[rank]
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item())
        return losses + [float(isinstance(model, hp.FSDPModule))]
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        torch.set_num_threads(threads)


def _accelerate_patched_and_torch():
    torch_losses = _accelerate_loop()
    with hp.patch_torch_fsdp():
        ours = _accelerate_loop()
    return torch_losses, ours


def test_accelerate_fsdp2_loop_matches_torch():
    pytest.importorskip("accelerate")
    for torch_losses, ours in run_on_ranks(2, _accelerate_patched_and_torch, timeout=240):
        assert torch_losses[-1] == 0.0 and ours[-1] == 1.0  # torch's fully_shard, then ours
        assert max(abs(a - b) for a, b in zip(ours[:-1], torch_losses[:-1])) <= 1e-12, (ours, torch_losses)
