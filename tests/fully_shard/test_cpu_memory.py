"""CPU memory of the collectives in flight: an in-flight reduce-scatter does not keep its
input alive on CPU (gloo's Work reads a copy made at issue), yet still overlaps the next
group's backward and gives the reference gradients; all-gathers issued during backward (the
prefetches) are not left in flight over the backward's compute, where gloo's receive buffer
would add an unsharded group's size to the peak."""

from __future__ import annotations

import weakref
from unittest import mock

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.core.fully_shard import collectives
from hyper_parallel.core.fully_shard.hooks import in_backward
from hyper_parallel.core.fully_shard.param_group import HSDPParamGroup
from hyper_parallel.platform import AcceleratorStreams, CpuStreams
from tests.fully_shard._helpers import TOL, global_batch, lm_loss, shard_layers_and_root, tiny_llama
from tests.multirank import run_on_ranks


def _reference_and_sharded():
    """A 3-block model, its FSDP-sharded copy over all ranks, and the global batch."""
    torch.manual_seed(0)
    reference = tiny_llama(n_layers=3)
    model = tiny_llama(n_layers=3)
    model.load_state_dict(reference.state_dict())
    shard_layers_and_root(model, mesh=hp.init_device_mesh("cpu", (dist.get_world_size(),)))
    return reference, model, global_batch(0)


def _assert_grads_match(model, reference, tokens) -> None:
    """The sharded model's gradients equal the reference's on the global batch."""
    lm_loss(reference, tokens).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    diff = max((grads[n] - p.grad).abs().max().item() for n, p in reference.named_parameters())
    assert diff < TOL, diff


def _inputs_released_in_flight():
    issued, seen_in_flight = [], []
    reduce_scatter, finish_scatter = collectives.reduce_scatter, HSDPParamGroup.finish_scatter

    def record_input(output, full, group, async_op, comm=None):
        issued.append(weakref.ref(full))
        return reduce_scatter(output, full, group, async_op, comm)

    def check_then_finish(group):
        # Called one group later (the overlap): the collective is still in flight here.
        seen_in_flight.append([ref() is None for ref in issued])
        return finish_scatter(group)

    reference, model, tokens = _reference_and_sharded()
    with mock.patch.object(collectives, "reduce_scatter", record_input), \
            mock.patch.object(HSDPParamGroup, "finish_scatter", check_then_finish):
        lm_loss(model, tokens.chunk(dist.get_world_size())[dist.get_rank()]).backward()
    # 4 groups; the first three finish while a later group's backward runs, the root at the end.
    assert len(issued) == 4 and len(seen_in_flight) == 4, (len(issued), len(seen_in_flight))
    assert all(all(dead) for dead in seen_in_flight), seen_in_flight
    _assert_grads_match(model, reference, tokens)
    return True


def test_cpu_reduce_scatter_input_released_while_in_flight():
    assert all(run_on_ranks(2, _inputs_released_in_flight, timeout=120))


def _backward_all_gathers_synchronous():
    gathers = []  # (issued during backward, async_op) per all-gather
    all_gather = collectives.all_gather

    def record(output, shard, group, async_op):
        gathers.append((in_backward(), async_op))
        return all_gather(output, shard, group, async_op)

    reference, model, tokens = _reference_and_sharded()
    local = tokens.chunk(dist.get_world_size())[dist.get_rank()]
    lm_loss(model, local).backward()  # step 1 sets the forward order that step 2 prefetches in
    model.zero_grad()
    with mock.patch.object(collectives, "all_gather", record):
        lm_loss(model, local).backward()
    backward = [async_op for during, async_op in gathers if during]
    forward = [async_op for during, async_op in gathers if not during]
    assert len(backward) == 3 and not any(backward), gathers  # blocks 2, 1, 0: sync
    assert any(forward), gathers  # the forward prefetches still overlap compute
    _assert_grads_match(model, reference, tokens)
    return True


def test_cpu_backward_all_gathers_complete_before_compute():
    assert all(run_on_ranks(2, _backward_all_gathers_synchronous, timeout=120))


def test_accelerator_streams_hold_the_input():
    tensor = torch.zeros(4)
    assert CpuStreams().hold_for_collective(tensor) is None
    # No accelerator needed: the method does not touch the device module.
    streams = AcceleratorStreams.__new__(AcceleratorStreams)
    assert streams.hold_for_collective(tensor) is tensor
