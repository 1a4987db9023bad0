"""torch's FSDP2 arguments given to hyper_parallel.fully_shard: torch's policy objects are
converted (never ignored), torch's ``dp_mesh_dims`` is refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed import fsdp as torch_fsdp

import hyper_parallel as hp
from hyper_parallel.core.fully_shard.policy import as_mp_policy, as_offload_policy
from tests.fully_shard._helpers import TOL, full_params, global_batch, max_diff, shard_layers_and_root, tiny_llama, train
from tests.fully_shard.test_cpu_offload import _TransferSpy
from tests.multirank import run_on_ranks


def test_torch_policies_convert_field_by_field():
    mp = as_mp_policy(torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                      output_dtype=torch.float16, cast_forward_inputs=False))
    assert mp == hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                         output_dtype=torch.float16, cast_forward_inputs=False)
    assert as_offload_policy(torch_fsdp.CPUOffloadPolicy(pin_memory=False)) == hp.CPUOffloadPolicy(pin_memory=False)
    assert type(as_offload_policy(torch_fsdp.OffloadPolicy())) is hp.OffloadPolicy
    with pytest.raises(TypeError, match="mp_policy must be a MixedPrecisionPolicy"):
        as_mp_policy({"param_dtype": torch.bfloat16})

    class OtherOffload(torch_fsdp.OffloadPolicy):
        pass

    with pytest.raises(TypeError, match="got OtherOffload"):
        as_offload_policy(OtherOffload())


def _train_with(mp_policy) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = tiny_llama()
    if mp_policy is not None:
        shard_layers_and_root(model, mp_policy=mp_policy)
        # converted, not used by duck typing (torch 2.13's policy lacks param_dtype_override_fn)
        assert type(model._state.mp_policy) is hp.MixedPrecisionPolicy
    else:
        shard_layers_and_root(model)
    train(model, [global_batch(step).chunk(world)[rank] for step in range(2)])
    return full_params(model)


def _mixed_precision_runs():
    fields = dict(param_dtype=torch.float32, reduce_dtype=torch.float32)
    torch_run = _train_with(torch_fsdp.MixedPrecisionPolicy(**fields))
    ours = _train_with(hp.MixedPrecisionPolicy(**fields))
    plain = _train_with(None)
    return max_diff(torch_run, ours), max_diff(torch_run, plain)


def test_torch_mixed_precision_policy_matches_ours():
    for same, cast in run_on_ranks(2, _mixed_precision_runs, timeout=180):
        assert same <= TOL, same
        assert cast > 1e-7, cast  # the float32 compute really happened (not ignored)


def _torch_offload_run():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = tiny_llama()
    reference = copy.deepcopy(model)
    shard_layers_and_root(model, offload_policy=torch_fsdp.CPUOffloadPolicy(pin_memory=False))
    batches = [global_batch(step) for step in range(2)]
    with _TransferSpy() as spy:
        train(model, [b.chunk(world)[rank] for b in batches])
    train(reference, batches)
    return len(spy.reduced), spy.reduced_grads_moved(torch.device("cpu")), max_diff(full_params(model),
                                                                                    full_params(reference))


def test_torch_cpu_offload_policy_offloads():
    for reduced, moved, diff in run_on_ranks(2, _torch_offload_run, timeout=180):
        assert reduced > 0 and moved == reduced, (reduced, moved)  # every reduced gradient went to the host
        assert diff <= TOL, diff


def _dp_mesh_dims_refused():
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    dims = torch_fsdp.DataParallelMeshDims(shard="dp_shard")
    try:
        hp.fully_shard(tiny_llama(), mesh=mesh, dp_mesh_dims=dims)
    except ValueError as err:
        return str(err)
    return "accepted"


def test_dp_mesh_dims_refused_in_one_line():
    for message in run_on_ranks(1, _dp_mesh_dims_refused, timeout=60):
        assert "dp_mesh_dims" in message and "mesh=full_mesh[" in message and "\n" not in message, message
