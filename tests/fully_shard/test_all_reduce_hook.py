"""FSDPModule.set_all_reduce_hook: the hook runs in place on the reduced, averaged gradient,
after the reduce-scatter (FSDP) or after the replicate all-reduce (HSDP).

Checked in float64 against single-process gradients on the global batch (see
[Note: parity in float64] in _helpers.py). The main hook squares with sign, which is not
linear: its result tells whether it ran on the fully reduced and divided gradient (on a
partial sum, or before the division, it gives other values).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from tests.fully_shard._helpers import TOL, global_batch, lm_loss, max_diff, shard_layers_and_root, tiny_llama
from tests.multirank import run_on_ranks


def _signed_square(grad: torch.Tensor) -> None:
    grad.mul_(grad.abs())


def _grads(model, reference, local_batch, batch):
    lm_loss(model, local_batch).backward()
    lm_loss(reference, batch).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return grads, {n: p.grad for n, p in reference.named_parameters()}


def _hooked_grads(mesh, hook, dp_rank: int, dp_size: int, stream=None) -> float:
    """(full gradients of the wrapped model with ``hook`` set on every group, reference gradients)."""
    torch.manual_seed(0)
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    shard_layers_and_root(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, hp.FSDPModule):
            module.set_all_reduce_hook(hook, stream=stream)
    batch = global_batch(0)
    grads, ref = _grads(model, reference, batch.chunk(dp_size)[dp_rank], batch)
    return grads, ref


def _hook_on_fsdp():
    mesh = hp.init_device_mesh("cpu", (2,))
    stream, streams_seen = torch.cpu.Stream(), []

    def hook(grad: torch.Tensor) -> None:
        streams_seen.append(torch.cpu.current_stream() == stream)
        _signed_square(grad)

    grads, ref = _hooked_grads(mesh, hook, dist.get_rank(), 2, stream=stream)
    for g in ref.values():
        _signed_square(g)
    assert streams_seen and all(streams_seen), streams_seen  # the hook runs on the given stream
    return max_diff(grads, ref)


def test_all_reduce_hook_fsdp_runs_on_the_reduce_scattered_mean():
    for diff in run_on_ranks(2, _hook_on_fsdp, timeout=180):
        assert diff <= TOL, diff


def _hook_on_hsdp():
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    grads, ref = _hooked_grads(mesh, _signed_square, dist.get_rank(), 4)
    for g in ref.values():
        _signed_square(g)
    with pytest.raises(ValueError, match="stream cannot be set when using native HSDP"):
        hp.fully_shard(tiny_llama(), mesh=mesh).set_all_reduce_hook(_signed_square, stream=object())
    return max_diff(grads, ref)


def test_all_reduce_hook_hsdp_runs_after_the_replicate_all_reduce():
    for diff in run_on_ranks(4, _hook_on_hsdp, timeout=240):
        assert diff <= TOL, diff


def _custom_replication():
    """FSDP over the 2-rank shard dim of a 2x2 mesh; the hook averages over the replicate
    dim with its own all-reduce: the gradients of the 4-rank global batch (manual HSDP)."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    replicate = mesh.get_group("replicate")

    def average_over_replicas(grad: torch.Tensor) -> None:
        dist.all_reduce(grad, group=replicate)
        grad.div_(dist.get_world_size(replicate))

    grads, ref = _hooked_grads(mesh["shard"], average_over_replicas, dist.get_rank(), 4)
    return max_diff(grads, ref)


def test_all_reduce_hook_custom_replicate_all_reduce_matches_global_batch():
    for diff in run_on_ranks(4, _custom_replication, timeout=240):
        assert diff <= TOL, diff
