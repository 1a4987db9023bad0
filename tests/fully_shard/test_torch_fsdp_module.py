"""Modules wrapped by hyper_parallel.fully_shard are torch ``FSDPModule`` instances whose every
torch method runs on our state: programs that swap only ``fully_shard`` (torchtitan's
``isinstance(m, FSDPModule)`` settings) get the settings applied, never silently skipped. Float64
checks of torch 2.13/2.15's extra ``FSDPModule`` methods against single-process math."""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

import hyper_parallel as hp
from hyper_parallel.core.fully_shard.torch_methods import torch_public_methods
from tests.fully_shard._helpers import TOL, global_batch
from tests.fully_shard.test_dropin import _mlp, _mse_of_scaled_tokens, _wrap_mlp
from tests.multirank import run_on_ranks

# The FSDPModule methods torch 2.13 has beyond hyper_parallel's original set.
TORCH_213_EXTRAS = {"set_force_sum_reduction_for_comms", "set_custom_all_gather", "set_custom_reduce_scatter",
                    "set_symm_mem_for_comm", "set_reduce_scatter_divide_factor", "set_reduce_scatter_unused_params",
                    "set_reduce_scatter_max_input_buffers", "set_separate_reduce_scatter_group",
                    "set_allocate_memory_from_process_group_for_comm"}


def test_every_torch_method_is_ours():
    """No method of torch's FSDPModule (public, or the private ones torch code calls) can run
    torch's implementation on our state."""
    names = set(torch_public_methods()) | {"_apply", "_get_fsdp_state", "_set_unshard_async_op", "__new__"}
    assert TORCH_213_EXTRAS <= names, TORCH_213_EXTRAS - names
    assert issubclass(hp.FSDPModule, TorchFSDPModule)
    for name in sorted(names):
        ours = getattr(hp.FSDPModule, name)
        assert ours is not getattr(TorchFSDPModule, name), name
        assert ours.__module__.startswith("hyper_parallel."), (name, ours.__module__)


def _grads(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}


def _diff(model: nn.Module, expected: Dict[str, torch.Tensor], scale: float = 1.0) -> float:
    grads = _grads(model)
    assert grads.keys() == expected.keys()
    return max((grads[k] - scale * expected[k]).abs().max().item() for k in grads)


def _reference_grads(batch: torch.Tensor) -> Dict[str, torch.Tensor]:
    torch.manual_seed(0)
    reference = _mlp()
    _mse_of_scaled_tokens(reference, batch).backward()
    return {name: p.grad for name, p in reference.named_parameters()}


def _wrapped() -> nn.Module:
    torch.manual_seed(0)
    return _wrap_mlp(_mlp())


def _step(model: nn.Module, batch: torch.Tensor) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    _mse_of_scaled_tokens(model, batch.chunk(world)[rank]).backward()


class _RecordingAllGather:
    def __init__(self):
        self.groups: List[dist.ProcessGroup] = []

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output, input, group, async_op=False):
        self.groups.append(group)
        return dist.all_gather_single(output, input, group=group, async_op=async_op)


class _RecordingReduceScatter(_RecordingAllGather):
    def __call__(self, output, input, group, op, async_op=False):
        self.groups.append(group)
        return dist.reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def _torch_methods_on_ranks():
    world = dist.get_world_size()
    batch = global_batch(0)
    expected = _reference_grads(batch)
    diffs = {}

    # torchtitan's "sum, don't average", found through torch's class.
    model = _wrapped()
    found = [m for m in model.modules() if isinstance(m, TorchFSDPModule)]
    for module in found:
        module.set_gradient_divide_factor(1.0)
    _step(model, batch)
    diffs["sum_via_torch_isinstance"] = _diff(model, expected, scale=world)
    diffs["found"] = float(len(found) != 3)

    model = _wrapped()
    for module in model.modules():
        if isinstance(module, TorchFSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # SUM collectives, still the average
            module.set_reduce_scatter_unused_params(True)
    _step(model, batch)
    diffs["force_sum"] = _diff(model, expected)

    model = _wrapped()
    for module in (model.in_proj, model.out_proj):
        module.set_reduce_scatter_divide_factor(4.0)
    _step(model, batch)
    diffs["divide_factor_4"] = _diff(model, expected, scale=world / 4.0)

    # Custom collectives over a separate reduce-scatter process group (same ranks).
    model = _wrapped()
    gather, scatter = _RecordingAllGather(), _RecordingReduceScatter()
    model.set_separate_reduce_scatter_group()
    for module in (model.in_proj, model.out_proj):
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(scatter)
    _step(model, batch)
    diffs["custom_comms"] = _diff(model, expected)
    shard_group = model.in_proj.weight.device_mesh.get_group()
    assert len(gather.groups) == 4 and all(g is shard_group for g in gather.groups), gather.groups  # fwd + bwd
    assert len(scatter.groups) == 2 and all(g is not shard_group for g in scatter.groups), scatter.groups
    assert dist.get_process_group_ranks(scatter.groups[0]) == dist.get_process_group_ranks(shard_group)

    # Manual finalization (torch's pipelining): two micro-batches accumulate, finalize reduces.
    model = _wrapped()
    model.set_manual_backward_finalization(True)
    model.set_requires_gradient_sync(False)
    rank = dist.get_rank()
    for micro in batch.chunk(world)[rank].chunk(2):
        (_mse_of_scaled_tokens(model, micro) / 2).backward()
    unreduced = [p.grad is None for p in model.parameters()]
    model.set_requires_gradient_sync(True)
    model.finalize_backward(async_op=True).wait()
    model.set_manual_backward_finalization(False)
    diffs["manual_finalization"] = _diff(model, expected)
    diffs["grads_before_finalize"] = float(not all(unreduced))

    errors = []
    for call in (lambda: model.set_symm_mem_for_comm(),
                 lambda: model.set_allocate_memory_from_process_group_for_comm(True),
                 lambda: model.set_keep_unsharded_storage(True),
                 lambda: model.set_reduce_scatter_max_input_buffers(2),
                 lambda: model.in_proj.set_manual_backward_finalization(True),
                 lambda: model._get_fsdp_state()):
        try:
            call()
            errors.append("no error")
        except (ValueError, RuntimeError) as err:
            errors.append(str(err))
    return diffs, errors


def test_torch_fsdp_module_methods_float64():
    for diffs, errors in run_on_ranks(2, _torch_methods_on_ranks, timeout=180):
        assert all(v <= TOL for v in diffs.values()), diffs
        assert all("\n" not in e and e != "no error" for e in errors), errors
        assert "not supported" in errors[0] and "root" in errors[4], errors
