"""Profiler ranges around fully_shard's collectives carry the qualified names of the group's
modules under the root, as FSDP2's ``FSDP::all_gather (layers.0)`` do."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import hyper_parallel as hp
from tests.fully_shard._helpers import global_batch, lm_loss, tiny_llama
from tests.multirank import run_on_ranks


def _labels():
    torch.manual_seed(0)
    model = tiny_llama()
    for block in model.layers.values():
        hp.fully_shard(block)
    hp.fully_shard([model.norm, model.output])
    hp.fully_shard(model)
    batch = global_batch(0).chunk(dist.get_world_size())[dist.get_rank()]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        lm_loss(model, batch).backward()
    return {event.name for event in prof.events() if event.name.startswith("hp::")}


def test_collective_ranges_name_the_groups_modules():
    for labels in run_on_ranks(2, _labels, timeout=120):
        for name in ("layers.0", "layers.1", "norm, output"):
            assert f"hp::all_gather ({name})" in labels, labels
            assert f"hp::all_gather_copy_out ({name})" in labels, labels
            assert f"hp::reduce_scatter ({name})" in labels, labels
        assert {"hp::all_gather", "hp::reduce_scatter"} <= labels, labels  # the root: no name
