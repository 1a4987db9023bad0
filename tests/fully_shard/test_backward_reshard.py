"""Backward frees a module's unsharded parameters before the next module's backward
prefetch: its reshard runs in an autograd node on its inputs, which the engine runs before
the gradient reaches the hooks of the previous module's outputs (the same tensors). At most
two blocks are unsharded when a backward all-gather is issued, as with FSDP2. Backward
prefetches follow the reverse post-forward order, also with groups nested in groups."""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel._torch_compat import current_graph_task_id
from hyper_parallel.core.fully_shard.param_group import HSDPParamGroup
from hyper_parallel.core.fully_shard.step_phase import ShardState
from tests.fully_shard._helpers import TOL, global_batch, lm_loss, tiny_llama
from tests.multirank import run_on_ranks

N_LAYERS = 4


def _unsharded_at_backward_prefetch():
    torch.manual_seed(0)
    reference = tiny_llama(n_layers=N_LAYERS)
    model = tiny_llama(n_layers=N_LAYERS)
    model.load_state_dict(reference.state_dict())
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers.values():
        hp.fully_shard(block, mesh=mesh)
    hp.fully_shard(model, mesh=mesh)
    blocks = {block._hsdp_state.group: i for i, block in enumerate(model.layers.values())}
    tokens = global_batch(0).chunk(dist.get_world_size())[dist.get_rank()]
    lm_loss(model, tokens)  # a first forward records the order the backward prefetches follow

    seen: List[tuple] = []
    unshard = HSDPParamGroup.unshard

    def record(group, async_op=False, ordered=False):
        if async_op and current_graph_task_id() != -1 and group in blocks:  # a backward prefetch
            held = sorted(blocks[g] for g in blocks
                          if g is not group and g.state in (ShardState.UNSHARDED, ShardState.UNSHARDING))
            seen.append((blocks[group], held))
        return unshard(group, async_op=async_op, ordered=ordered)

    HSDPParamGroup.unshard = record
    try:
        lm_loss(model, tokens).backward()
    finally:
        HSDPParamGroup.unshard = unshard
    # Block k is prefetched in block k+1's pre-backward (the last block in the root's): block
    # k+2 is resharded by then.
    expected = [(k, [k + 1] if k + 1 < N_LAYERS else []) for k in reversed(range(N_LAYERS))]
    assert seen == expected, seen
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    lm_loss(reference, global_batch(0)).backward()
    diff = max((grads[n] - p.grad).abs().max().item() for n, p in reference.named_parameters())
    assert diff < TOL, diff
    return True


def test_block_resharded_before_the_previous_blocks_prefetch():
    assert all(run_on_ranks(2, _unsharded_at_backward_prefetch, timeout=120))


class _NestedBlock(torch.nn.Module):
    """A block with an inner module sharded on its own (as the experts inside an MoE block)."""

    def __init__(self, dim: int):
        super().__init__()
        self.attention, self.experts, self.out = (torch.nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x):
        h = torch.tanh(self.attention(x))
        return x + self.out(torch.tanh(self.experts(h)))


class _NestedModel(torch.nn.Module):
    def __init__(self, dim: int = 8, n_blocks: int = 3):
        super().__init__()
        self.inp, self.head = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, 1)
        self.blocks = torch.nn.ModuleList(_NestedBlock(dim) for _ in range(n_blocks))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def _backward_gathers_of_nested_groups():
    torch.manual_seed(0)
    reference = _NestedModel().to(torch.float64)
    model = _NestedModel().to(torch.float64)
    model.load_state_dict(reference.state_dict())
    for block in model.blocks:
        hp.fully_shard(block.experts)
        hp.fully_shard(block)
    hp.fully_shard(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = torch.randn(world * 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    model(inputs.chunk(world)[rank]).backward()  # a first step: no order carries over from it
    model.zero_grad()

    gathers: List[tuple] = []  # (kind, group) of each all-gather issued in backward
    unshard = HSDPParamGroup.unshard

    def record(group, async_op=False, ordered=False):
        if current_graph_task_id() != -1 and group.state in (ShardState.SHARDED, ShardState.SHARDED_POST_FORWARD):
            gathers.append(("prefetch" if async_op else "synchronous", group.module_fqn))
        return unshard(group, async_op=async_op, ordered=ordered)

    HSDPParamGroup.unshard = record
    try:
        model(inputs.chunk(world)[rank]).backward()
    finally:
        HSDPParamGroup.unshard = unshard
    ours = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    (sum(reference(chunk) for chunk in inputs.chunk(world)) / world).backward()
    diff = max((ours[n] - p.grad).abs().max().item() for n, p in reference.named_parameters())
    return gathers, diff


def test_backward_prefetch_follows_the_post_forward_order_of_nested_groups():
    """Experts sharded inside each block: post-forward order b0.experts, b0, b1.experts, b1, ...
    Every backward all-gather is a prefetch (the last block's by the root), each issued one
    group ahead in reverse post-forward order: none waits synchronously, and no experts group
    is gathered a block early."""
    expected = [("prefetch", name) for k in reversed(range(3)) for name in (f"blocks.{k}", f"blocks.{k}.experts")]
    for gathers, diff in run_on_ranks(2, _backward_gathers_of_nested_groups, timeout=120):
        assert gathers == expected, gathers
        assert diff < 1e-12, diff


class _ScalesItsInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)
        return self.linear(x)


def _in_place_on_input():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _ScalesItsInput())
    hp.fully_shard(model[1])
    hp.fully_shard(model)
    try:
        model(torch.randn(2, 4)).sum().backward()
    except RuntimeError as exc:
        assert "FullyShardModuleInputs is a view and is being modified inplace" in str(exc), exc
        return True
    raise AssertionError("an in-place update of a wrapped module's input did not raise")


def test_in_place_update_of_an_input_is_refused_as_in_fsdp2():
    assert all(run_on_ranks(1, _in_place_on_input, timeout=60))


def _two_forwards_then_backward():
    """DPO's pattern (two forwards, one backward of a loss of both), and a forward whose
    backward never runs before a normal step: gradients match single-process training."""
    torch.manual_seed(0)
    reference = tiny_llama(n_layers=3, dtype=torch.float64)
    model = tiny_llama(n_layers=3, dtype=torch.float64)
    model.load_state_dict(reference.state_dict())
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers.values():
        hp.fully_shard(block.attention, mesh=mesh)
        hp.fully_shard(block, mesh=mesh)
    hp.fully_shard(model, mesh=mesh)
    rank, world = dist.get_rank(), dist.get_world_size()
    first, second = global_batch(0), global_batch(1)

    def dpo(m, a, b):
        return (m(a).sum() - m(b).sum()).pow(2) / 1e6

    dpo(model, first.chunk(world)[rank], second.chunk(world)[rank]).backward()
    ours = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    # each rank's loss on its slice, averaged over ranks (the data-parallel mean)
    (sum(dpo(reference, first.chunk(world)[r], second.chunk(world)[r]) for r in range(world)) / world).backward()
    diffs = {"two forwards": max((ours[n] - p.grad).abs().max().item() for n, p in reference.named_parameters())}
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    lm_loss(model, first.chunk(world)[rank])  # its backward never runs
    lm_loss(model, second.chunk(world)[rank]).backward()
    ours = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    lm_loss(reference, second).backward()
    diffs["after a forward without backward"] = max((ours[n] - p.grad).abs().max().item()
                                                    for n, p in reference.named_parameters())
    return diffs


def test_two_forwards_then_one_backward_and_a_forward_without_backward():
    for result in run_on_ranks(2, _two_forwards_then_backward, timeout=120):
        assert all(d < 1e-10 for d in result.values()), result


class _ChunkedHead(torch.nn.Module):
    """``norm`` and ``head`` are one group; the forward may skip ``head``, which the loss then
    calls on detached chunks, each with a backward of its own, before ``h.backward``."""

    def __init__(self):
        super().__init__()
        self.inp, self.body = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
        self.norm, self.head = torch.nn.LayerNorm(6), torch.nn.Linear(6, 5)

    def forward(self, x, skip_head: bool = False):
        h = self.norm(torch.tanh(self.body(self.inp(x))))
        return h if skip_head else self.head(h)


def _chunked_step(model, x):
    h = model(x, skip_head=True)
    grads = []
    for chunk in h.detach().chunk(2):
        chunk.requires_grad_(True)
        model.head(chunk).square().sum().backward()
        grads.append(chunk.grad)
    h.backward(torch.cat(grads))


def _backwards_within_one_step():
    torch.manual_seed(0)
    reference = _ChunkedHead().to(torch.float64)
    model = _ChunkedHead().to(torch.float64)
    model.load_state_dict(reference.state_dict())
    mesh = hp.init_device_mesh("cpu", (dist.get_world_size(),))
    hp.fully_shard(model.body, mesh=mesh)
    hp.fully_shard([model.norm, model.head], mesh=mesh)
    hp.fully_shard(model, mesh=mesh)
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = torch.randn(world, 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        _chunked_step(model, inputs[rank])
    for _ in range(2):
        for r in range(world):
            _chunked_step(reference, inputs[r])
    ours = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    return max((ours[n] - p.grad / world).abs().max().item() for n, p in reference.named_parameters())


def test_several_backwards_within_one_step_chunked_head():
    assert all(diff < 1e-12 for diff in run_on_ranks(2, _backwards_within_one_step, timeout=120))
