"""Ring attention (hyper_parallel.parallel.ring_attention) and its block math: exact against
attention over the whole sequence in one process, on gloo ranks.

Float64 throughout (see tests/fully_shard/_helpers.py, [Note: parity in float64]): the sharded
computation sums in another order than the reference, which is ~1e-16 relative noise; any
defect (a missing block, a wrong position, a lost gradient) is 1e-3 or more.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hyper_parallel.parallel import ring_attention as ring
from hyper_parallel.parallel.block_attention import BlockKernel, BlockMask, block_attention, merge_attention
from hyper_parallel.parallel.context import (Layout, Rotate, context_parallel, document_ids, document_masks,
                                             sequence_positions, shard_sequence)
from hyper_parallel.parallel.ring_attention import _MIN_TILE_ROWS, _plan, _tiles, cp_attention
from tests.multirank import run_on_ranks

TOL = 1e-12
MODEL_TOL = 1e-10  # a 2-block model: more operations between the noise and the result
D64 = torch.float64


def _qkv(seed: int, heads: int = 4, kv_heads: int = 2, seq: int = 16, batch: int = 2, dim: int = 8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, dim, generator=gen, dtype=D64)
    k = torch.randn(batch, kv_heads, seq, dim, generator=gen, dtype=D64)
    v = torch.randn(batch, kv_heads, seq, dim, generator=gen, dtype=D64)
    return q, k, v, torch.randn(batch, heads, seq, dim, generator=gen, dtype=D64)


def _sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def _grads(fn, tensors, dout):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


# --------------------------------------------------------------------------- one process


@pytest.mark.parametrize("causal", [False, True])
def test_block_attention_matches_sdpa_with_gqa(causal):
    q, k, v, dout = _qkv(0)
    mask = BlockMask.CAUSAL if causal else BlockMask.FULL
    out, lse = block_attention(q, k, v, mask)
    assert (out - _sdpa(q, k, v, causal)).abs().max() < TOL
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    assert (lse - scores.logsumexp(-1)).abs().max() < TOL
    masked_out, masked_lse = block_attention(q, k, v, BlockMask.MASKED)
    assert masked_out.abs().max() == 0 and bool((masked_lse == float("-inf")).all())


def test_merge_of_key_blocks_is_attention_over_their_union():
    q, k, v, dout = _qkv(1)

    def merged(q, k, v):
        first = block_attention(q, k[:, :, :5], v[:, :, :5])
        empty = block_attention(q, k[:, :, 5:], v[:, :, 5:], BlockMask.MASKED)
        second = block_attention(q, k[:, :, 5:], v[:, :, 5:])
        return merge_attention(*merge_attention(*first, *empty), *second)[0]

    out, grads = _grads(merged, (q, k, v), dout)
    ref_out, ref_grads = _grads(lambda q, k, v: _sdpa(q, k, v, False), (q, k, v), dout)
    assert (out - ref_out).abs().max() < TOL
    assert max((a - b).abs().max().item() for a, b in zip(grads, ref_grads)) < TOL


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("budget", [None, 10**9, 1])  # uncut (fused); whole blocks; tiles of the fewest rows
def test_ring_plan_covers_each_causal_pair_once(layout, budget):
    """The blocks (or tiles) each rank computes over the ring cover every (query, key) pair with
    key <= query exactly once, and no other pair (load-balanced: every rank the same number of pairs)."""
    seq = 24 * _MIN_TILE_ROWS // 4  # tiles of the fewest rows cut the chunks of cp 1..4
    for size in (1, 2, 3, 4):
        counts = torch.zeros(seq, seq, dtype=torch.long)
        work = []
        for rank in range(size):
            qpos = sequence_positions(seq // size, rank, size, layout)
            pairs = 0
            for src in range(size):
                kpos = sequence_positions(seq // size, src, size, layout)
                for rows, seen, mask, first in _tiles(_plan(rank, size, src, layout, True, seq // size), budget):
                    ok = torch.ones(rows.stop - rows.start, seen, dtype=torch.bool)
                    if mask is BlockMask.CAUSAL:
                        ok = ok.tril(first)
                    grid = counts[qpos[rows]][:, kpos[:seen]] + ok.long()
                    counts[qpos[rows].unsqueeze(1), kpos[:seen].unsqueeze(0)] = grid
                    pairs += int(ok.sum())
            work.append(pairs)
        assert torch.equal(counts, torch.ones(seq, seq, dtype=torch.long).tril()), (layout, size)
        if layout is Layout.HEAD_TAIL:
            assert len(set(work)) == 1, work


# --------------------------------------------------------------------------- the attention on ranks


def _attention_on_rank(seq: int) -> dict:
    """Max differences to whole-sequence attention (outputs, q/k/v gradients) per setting: the
    default (fused CPU) kernel, and the plain ops with whole blocks and with tiles of the fewest
    query rows; and the calls of the fused CPU kernel per kernel setting."""
    from hyper_parallel import _torch_compat as compat

    group = dist.group.WORLD
    rank, size = dist.get_rank(), dist.get_world_size()
    diffs, calls = {}, {}
    default, real = ring._TILE_SCORES, (compat.cpu_flash_attention, compat.cpu_flash_attention_backward)

    def counted(fn, key):
        def call(*args, **kwargs):
            calls[key] = calls.get(key, 0) + 1
            return fn(*args, **kwargs)
        return call
    kernels = (("default", None, default), ("plain", BlockKernel.PLAIN, default), ("plain tiles", BlockKernel.PLAIN, 1))
    try:
        for *setting, (name, kernel, tile) in itertools.product((True, False), Layout, Rotate, (1, 4), kernels):
            ring._KERNEL, ring._TILE_SCORES = kernel, tile
            compat.cpu_flash_attention, compat.cpu_flash_attention_backward = (
                counted(real[0], (name, "forward")), counted(real[1], (name, "backward")))
            diffs[" ".join(map(str, setting + [name]))] = _attention_diff(rank, size, group, seq, *setting)
    finally:
        ring._KERNEL, ring._TILE_SCORES = None, default
        compat.cpu_flash_attention, compat.cpu_flash_attention_backward = real
    return {"diffs": diffs, "calls": calls}


def _attention_diff(rank, size, group, seq, causal, layout, rotate, kv_heads) -> float:
    q, k, v, dout = _qkv(10 + kv_heads, heads=4, kv_heads=kv_heads, seq=seq)
    ref_out, ref_grads = _grads(lambda q, k, v: _sdpa(q, k, v, causal), (q, k, v), dout)
    with context_parallel(group, layout=layout.value, rotate=rotate.value) as cp:
        part = [cp.shard(t, dim=2) for t in (q, k, v)]
        out, grads = _grads(lambda q, k, v: cp_attention(q, k, v, is_causal=causal), part, cp.shard(dout, dim=2))
        gathered = cp.gather(out, dim=2)
    errors = [(out - shard_sequence(ref_out, rank, size, layout, 2)).abs().max(), (gathered - ref_out).abs().max()]
    errors += [(g - shard_sequence(r, rank, size, layout, 2)).abs().max() for g, r in zip(grads, ref_grads)]
    return max(e.item() for e in errors)


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_equals_whole_sequence_attention(world):
    for result in run_on_ranks(world, _attention_on_rank, 2 * _MIN_TILE_ROWS * world, timeout=180):
        diffs = result["diffs"]
        assert len(diffs) == 48 and max(diffs.values()) < TOL, diffs
        # the default path runs the fused CPU kernel, forward and backward; the plain one never
        assert set(result["calls"]) == {("default", "forward"), ("default", "backward")}, result["calls"]


def _cuda_kernels_in_the_ring_on_rank(seq: int) -> dict:
    """The ring with each CUDA block kernel forced, run by fakes under the kernels' contracts
    (tests/test_block_attention_kernels.FakeCudaKernels): max difference to whole-sequence
    attention, the facts the fakes recorded, and whether the backward had to copy ``out`` into
    the kernels' layout (it must not: the ring's output is kept in it)."""
    from hyper_parallel.parallel import block_attention as blocks
    from tests.test_block_attention_kernels import CUDA_KERNELS, FakeCudaKernels

    rank, size = dist.get_rank(), dist.get_world_size()
    real_layout, copies, result = blocks.kernel_layout, [], {}

    def recording_layout(t, dtype=None):
        laid = real_layout(t, dtype)
        copies.append(laid is not t)
        return laid
    blocks.kernel_layout = recording_layout
    try:
        for kernel, layout, causal in itertools.product(CUDA_KERNELS, Layout, (True, False)):
            ring._KERNEL = kernel
            with FakeCudaKernels() as fake:
                diff = _attention_diff(rank, size, dist.group.WORLD, seq, causal, layout, Rotate.RING, 2)
            result[f"{kernel.value} {layout.value} {causal}"] = (diff, fake.calls)
    finally:
        ring._KERNEL, blocks.kernel_layout = None, real_layout
    return {"settings": result, "copies": copies}


def test_ring_hands_the_cuda_kernels_what_they_read():
    """Ring attention with the CUDA kernels (fakes that read ``out`` as the kernels do): exact
    to the kernels' float32 log-sum-exp, ``out`` handed over in their layout without a copy,
    flash attention given the K/V heads as they are."""
    from tests.test_block_attention_kernels import FAKE_KERNEL_TOL

    for result in run_on_ranks(2, _cuda_kernels_in_the_ring_on_rank, 4 * _MIN_TILE_ROWS, timeout=120):
        assert len(result["settings"]) == 8 and result["copies"] and not any(result["copies"])
        for name, (diff, calls) in result["settings"].items():
            assert diff < FAKE_KERNEL_TOL, (name, diff)
            backwards = [facts for kind, facts in calls if kind.endswith("backward")]
            assert backwards and all(f["out_strides_ok"] and f["lse"] == (torch.float32, True) for f in backwards)
            assert {f["kv_heads"] for _, f in calls} == {2 if name.startswith("cuda_flash") else 4}, name


def _ring_backward_order_on_rank(rotate: str) -> list:
    """The ring backward's events in order: block gradient computations, and the starts and
    waits of the K/V and gradient shifts."""

    events, real_shift, real_wait, real_block = [], ring._shift, ring._Shift.wait, ring.block_attention_backward
    kinds = {ring._KV_TAG: "kv", ring._GRAD_TAG: "grad"}

    def shift(flat, cp, tag):
        events.append(f"start {kinds[tag]}")
        return real_shift(flat, cp, tag)

    def wait(pending):
        events.append(f"wait {kinds[pending.tag]}")
        return real_wait(pending)

    def block(*args, **kwargs):
        events.append("compute")
        return real_block(*args, **kwargs)
    q, k, v, dout = _qkv(5, seq=4 * dist.get_world_size())
    with context_parallel(dist.group.WORLD, rotate=rotate) as cp:
        leaves = [cp.shard(t, dim=2).requires_grad_() for t in (q, k, v)]
        out = cp_attention(*leaves, is_causal=False)
        ring._shift, ring._Shift.wait, ring.block_attention_backward = shift, wait, block
        try:
            out.backward(cp.shard(dout, dim=2))
        finally:
            ring._shift, ring._Shift.wait, ring.block_attention_backward = real_shift, real_wait, real_block
    return events


def test_ring_backward_overlaps_each_gradient_shift_with_the_next_block():
    """Each block's dK/dV shift is started and waited for only after the next block's gradients
    are computed (as torch's ring does); only the last shift, to the owner, has nothing left to
    overlap."""
    for events in run_on_ranks(2, _ring_backward_order_on_rank, "ring", timeout=60):
        grads = [e for e in events if e != "start kv" and e != "wait kv"]
        assert grads == ["compute", "start grad", "compute", "wait grad", "start grad", "wait grad"], events


# --------------------------------------------------------------------------- document masks


def _per_document_attention(q, k, v, documents, causal):
    """Attention of each document of each sequence on its own (SDPA per document)."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for doc in documents[b].unique():
            idx = (documents[b] == doc).nonzero().flatten()
            out[b, :, idx] = _sdpa(q[b:b + 1, :, idx], k[b:b + 1, :, idx], v[b:b + 1, :, idx], causal)[0]
    return out


def _document_masks_on_rank(seq: int) -> dict:
    """Max differences of ring attention with document masks (outputs, q/k/v gradients) to
    per-document attention in one process, per layout and causality; and how far the
    per-document attention is from attention over the whole sequences (the masks matter)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = _qkv(21, seq=seq)
    tokens = torch.randint(1, 9, (2, seq), generator=torch.Generator().manual_seed(4))
    tokens[0, [4, 5, 17, seq - 9]] = 0  # EOS: documents across the ranks' chunks, one of a single token
    tokens[1, [seq // 2 - 1]] = 0
    documents = document_ids(tokens, 0)
    diffs, effect = {}, 0.0
    for layout, causal in itertools.product(Layout, (True, False)):
        ref_out, ref_grads = _grads(lambda q, k, v: _per_document_attention(q, k, v, documents, causal), (q, k, v), dout)
        effect = max(effect, (ref_out - _sdpa(q, k, v, causal)).abs().max().item())
        with context_parallel(dist.group.WORLD, layout=layout.value, documents=documents) as cp:
            part = [cp.shard(t, dim=2) for t in (q, k, v)]
            out, grads = _grads(lambda q, k, v: cp_attention(q, k, v, is_causal=causal), part, cp.shard(dout, dim=2))
        errors = [(out - shard_sequence(ref_out, rank, size, layout, 2)).abs().max()]
        errors += [(g - shard_sequence(r, rank, size, layout, 2)).abs().max() for g, r in zip(grads, ref_grads)]
        diffs[f"{layout.value} causal={causal}"] = max(e.item() for e in errors)
    with pytest.raises(ValueError) as err:
        with context_parallel(dist.group.WORLD, documents=documents[:, :-2]) as cp:
            cp_attention(*[cp.shard(t, dim=2) for t in (q, k, v)])
    return {"diffs": diffs, "effect": effect, "error": str(err.value)}


def test_document_masks_in_ring_attention_equal_per_document_attention():
    """Packed sequences, documents ending at EOS: under CP2 (load-balanced and contiguous
    splits, causal and not) each token attends only within its document, exactly as attention
    run on each document alone (float64)."""
    for result in run_on_ranks(2, _document_masks_on_rank, 32, timeout=60):
        assert len(result["diffs"]) == 4 and max(result["diffs"].values()) < TOL, result
        assert result["effect"] > 1e-2  # the masks change the result: the comparison is not vacuous
        assert result["error"] == ("context_parallel: documents of shape (2, 30) do not match the (batch, global "
                                   "sequence) (2, 32) of the attention's inputs")


@pytest.mark.parametrize("causal", [True, False])
def test_document_masks_without_cp_equal_per_document_attention(causal):
    """Without CP, attention under ``document_masks`` (SDPA with the documents' mask) is attention
    run on each document alone, forward and backward (float64); a mismatched shape is named."""
    q, k, v, dout = _qkv(22, seq=12)
    tokens = torch.tensor([[3, 0, 5, 5, 0, 0, 7, 1, 2, 0, 4, 4], [1] * 6 + [0] + [2] * 5])
    documents = document_ids(tokens, 0)
    ref_out, ref_grads = _grads(lambda q, k, v: _per_document_attention(q, k, v, documents, causal), (q, k, v), dout)
    with document_masks(documents):
        out, grads = _grads(lambda q, k, v: cp_attention(q, k, v, is_causal=causal), (q, k, v), dout)
    assert max((a - b).abs().max().item() for a, b in zip((out, *grads), (ref_out, *ref_grads))) < TOL
    assert (ref_out - _sdpa(q, k, v, causal)).abs().max() > 1e-2  # the masks matter
    with pytest.raises(ValueError, match=r"documents of shape \(2, 11\) do not match the \(batch, sequence\) "
                                         r"\(2, 12\)"):
        with document_masks(documents[:, 1:]):
            cp_attention(q, k, v)
