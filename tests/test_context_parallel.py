"""Context parallelism: ring attention and the Llama model under CP, exact against one process.

Float64 throughout (see tests/fully_shard/_helpers.py, [Note: parity in float64]): the sharded
computation sums in another order than the reference, which is ~1e-16 relative noise; any
defect (a missing block, a wrong position, a lost gradient) is 1e-3 or more.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hyper_parallel as hp
from hyper_parallel.chunked_loss import ChunkedLoss
from hyper_parallel.context_parallel import (
    BlockKernel, BlockMask, Layout, Rotate, block_attention, context_parallel, cp_attention, current_context,
    gather_sequence, mean_token_loss, merge_attention, rope_rows, sequence_positions, shard_sequence,
    token_loss_scale,
)
from hyper_parallel.context_parallel import _MIN_TILE_ROWS, _plan, _tiles
from hyper_parallel.models import build_llama
from tests.fully_shard._helpers import CountingBackend
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


def test_layouts_shard_positions_and_errors():
    x = torch.arange(8).view(1, 8)
    assert [shard_sequence(x, r, 2).tolist() for r in range(2)] == [[[0, 1, 6, 7]], [[2, 3, 4, 5]]]
    assert shard_sequence(x, 1, 2, Layout.CONTIGUOUS).tolist() == [[4, 5, 6, 7]]
    for layout, size in itertools.product(Layout, (1, 2, 4)):
        for rank in range(size):
            assert sequence_positions(8 // size, rank, size, layout).tolist() == \
                shard_sequence(x, rank, size, layout)[0].tolist()
    with pytest.raises(ValueError, match="sequence length 12 is not divisible by the 8 chunks of the head_tail"):
        shard_sequence(torch.zeros(1, 12), 0, 4)


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


def test_mean_token_loss_and_errors_in_one_process():
    logits = torch.randn(2, 5, 7, dtype=D64)
    labels = torch.randint(0, 7, (2, 5))
    labels[0, 0] = -100
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    assert (mean_token_loss(logits, labels) - expected).abs() < TOL
    with pytest.raises(ValueError, match="no token to average over"):
        mean_token_loss(logits, torch.full_like(labels, -100))


def test_without_context_attention_is_sdpa_and_rope_unchanged():
    q, k, v, _ = _qkv(2)
    assert current_context() is None
    assert torch.equal(cp_attention(q, k, v), _sdpa(q, k, v, True))
    cos, sin = torch.randn(16, 4), torch.randn(16, 4)
    assert rope_rows(cos, sin, 8)[0] is cos


def test_context_rejects_bad_arguments():
    with pytest.raises(ValueError, match="needs a 1-D DeviceMesh or a ProcessGroup, got int"):
        with context_parallel(3):
            pass
    with pytest.raises(ValueError, match="'zigzag' is not a valid Layout; layouts: .'contiguous', 'head_tail'."):
        with context_parallel(dist.group.WORLD, layout="zigzag"):
            pass
    assert current_context() is None


def _errors_on_rank() -> list:
    """The one-line errors of bad input under CP on a rank."""
    found = []
    mesh = hp.init_device_mesh("cpu", (1, dist.get_world_size()))
    q, k, v, _ = _qkv(3, seq=9)
    with context_parallel(dist.group.WORLD) as cp:
        for call in (lambda: rope_rows(torch.zeros(8, 4), torch.zeros(8, 4), 8),
                     lambda: cp_attention(q, k, v),
                     lambda: cp_attention(q, k[:, :, :4], v[:, :, :4])):
            with pytest.raises(ValueError) as err:
                call()
            found.append(str(err.value))
    with pytest.raises(ValueError) as err:
        with context_parallel(mesh):
            pass
    return found + [str(err.value)]


def test_bad_input_under_cp_raises_one_line_errors():
    for found in run_on_ranks(2, _errors_on_rank, timeout=60):
        assert found == [
            "the global sequence length 16 (local 8 x cp 2) exceeds the RoPE tables' 8 rows (max_seq_len)",
            "sequence length 18 is not divisible by the 4 chunks of the head_tail layout over 2 "
            "context-parallel rank(s)",
            "context-parallel attention needs queries, keys and values of the same local length, got 9, 4, 4",
            "context_parallel needs a 1-D mesh (e.g. mesh['cp']), got a 2-D mesh",
        ], found


# --------------------------------------------------------------------------- the attention on ranks


def _attention_on_rank(seq: int) -> dict:
    """Max differences to whole-sequence attention (outputs, q/k/v gradients) per setting: the
    default (fused CPU) kernel, and the plain ops with whole blocks and with tiles of the fewest
    query rows; and the calls of the fused CPU kernel per kernel setting."""
    from hyper_parallel import _torch_compat as compat
    from hyper_parallel import context_parallel as module

    group = dist.group.WORLD
    rank, size = dist.get_rank(), dist.get_world_size()
    diffs, calls = {}, {}
    default, real = module._TILE_SCORES, (compat.cpu_flash_attention, compat.cpu_flash_attention_backward)

    def counted(fn, key):
        def call(*args, **kwargs):
            calls[key] = calls.get(key, 0) + 1
            return fn(*args, **kwargs)
        return call
    kernels = (("default", None, default), ("plain", BlockKernel.PLAIN, default), ("plain tiles", BlockKernel.PLAIN, 1))
    try:
        for *setting, (name, kernel, tile) in itertools.product((True, False), Layout, Rotate, (1, 4), kernels):
            module._KERNEL, module._TILE_SCORES = kernel, tile
            compat.cpu_flash_attention, compat.cpu_flash_attention_backward = (
                counted(real[0], (name, "forward")), counted(real[1], (name, "backward")))
            diffs[" ".join(map(str, setting + [name]))] = _attention_diff(rank, size, group, seq, *setting)
    finally:
        module._KERNEL, module._TILE_SCORES = None, default
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
    from hyper_parallel import block_attention as blocks
    from hyper_parallel import context_parallel as module
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
            module._KERNEL = kernel
            with FakeCudaKernels() as fake:
                diff = _attention_diff(rank, size, dist.group.WORLD, seq, causal, layout, Rotate.RING, 2)
            result[f"{kernel.value} {layout.value} {causal}"] = (diff, fake.calls)
    finally:
        module._KERNEL, blocks.kernel_layout = None, real_layout
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
    from hyper_parallel import context_parallel as module

    events, real_shift, real_wait, real_block = [], module._shift, module._Shift.wait, module.block_attention_backward
    kinds = {module._KV_TAG: "kv", module._GRAD_TAG: "grad"}

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
        module._shift, module._Shift.wait, module.block_attention_backward = shift, wait, block
        try:
            out.backward(cp.shard(dout, dim=2))
        finally:
            module._shift, module._Shift.wait, module.block_attention_backward = real_shift, real_wait, real_block
    return events


def test_ring_backward_overlaps_each_gradient_shift_with_the_next_block():
    """Each block's dK/dV shift is started and waited for only after the next block's gradients
    are computed (as torch's ring does); only the last shift, to the owner, has nothing left to
    overlap."""
    for events in run_on_ranks(2, _ring_backward_order_on_rank, "ring", timeout=60):
        grads = [e for e in events if e != "start kv" and e != "wait kv"]
        assert grads == ["compute", "start grad", "compute", "wait grad", "start grad", "wait grad"], events


# --------------------------------------------------------------------------- the Llama model on ranks

SEQ = 32  # divisible by 2 * cp for cp in (1, 2, 4)


def _llama() -> torch.nn.Module:
    model = build_llama("llama_debug", max_seq_len=SEQ).to(D64)  # GQA: 4 heads, 2 kv heads
    model.init_weights(seed=3)
    return model


def _tokens(batch: int) -> torch.Tensor:
    return torch.randint(0, 256, (batch, SEQ + 1), generator=torch.Generator().manual_seed(7))


def _labels(tokens: torch.Tensor) -> torch.Tensor:
    """Next tokens, the first 5 of sequence 0 ignored: ranks hold different numbers of tokens."""
    labels = tokens[:, 1:].clone()
    labels[0, :5] = -100
    return labels


def _llama_on_rank(setting: str, dp: int) -> dict:
    """Loss and parameter gradients of one step under CP (and FSDP etc., per ``setting``; "tp":
    tensor parallelism over 2 ranks, the mesh ``shard x cp x tp`` as in the recipe) minus
    those of the whole model on the whole global batch in this process."""
    from hyper_parallel.parallel import apply_tensor_parallel, loss_parallel
    from hyper_parallel.trainer.context import dp_cp_mesh
    from hyper_parallel.trainer.parallelize import apply_activation_checkpointing

    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = _tokens(2 * dp)
    labels = _labels(tokens)
    reference = _llama()
    logits = reference(tokens[:, :-1])
    ref_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    ref_loss.backward()

    tp = 2 if "tp" in setting else 1
    mesh = hp.init_device_mesh("cpu", (dp, world // (dp * tp), tp), mesh_dim_names=("shard", "cp", "tp"))
    everyone = dp_cp_mesh(mesh)  # FSDP shards over dp x cp (not tp)
    model = copy.deepcopy(reference)
    model.zero_grad(set_to_none=True)
    if tp > 1:  # each rank's heads; the logits stay sharded on the vocabulary
        apply_tensor_parallel(model, mesh["tp"])
    if "ac" in setting:
        apply_activation_checkpointing(model)
    if "fsdp" in setting:
        for block in model.layers.values():
            hp.fully_shard(block, mesh=everyone)
        hp.fully_shard(model, mesh=everyone)
    backend = CountingBackend("aot_eager")
    if "compile" in setting:  # graph breaks at the ring exchange (torch.compiler.disable)
        model.compile(backend=backend)
    inputs, targets = (t.chunk(dp)[mesh.get_local_rank("shard")] for t in (tokens[:, :-1], labels))
    with context_parallel(mesh["cp"]) as cp, loss_parallel():
        if "chunks" in setting:  # the loss in 3 chunks of the rank's part: the logits never whole
            part = cp.shard(targets)
            summed = model(cp.shard(inputs), loss=ChunkedLoss(part, 3))
            loss = summed * token_loss_scale(part, everyone.get_group())
        else:
            logits = model(cp.shard(inputs))
            assert isinstance(logits, hp.DTensor) == (tp > 1)
            loss = mean_token_loss(logits, cp.shard(targets), group=everyone.get_group())
        loss.backward()
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss, op=dist.ReduceOp.AVG)
    grad_diff = 0.0
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        grad = param.grad
        if isinstance(grad, hp.DTensor):
            grad = grad.full_tensor()
        else:  # what data-parallel averaging does
            dist.all_reduce(grad, op=dist.ReduceOp.AVG)
        grad_diff = max(grad_diff, (grad - ref.grad).abs().max().item())
    return {"loss": abs(global_loss.item() - ref_loss.item()), "grads": grad_diff, "compiled_calls": backend.calls,
            "grad_scale": max(p.grad.abs().max().item() for p in reference.parameters())}


@pytest.mark.parametrize("world,dp,setting", [
    (2, 1, "plain"), (2, 1, "fsdp"), (2, 1, "fsdp ac"), (2, 1, "fsdp ac chunks"),
    pytest.param(2, 1, "fsdp compile", marks=pytest.mark.slow),  # CP compiled: test_compile_recipe.py
    (4, 1, "plain"), (4, 2, "fsdp"), (4, 2, "fsdp ac"), (4, 1, "fsdp tp"),
])
def test_llama_under_cp_equals_one_process(world, dp, setting):
    for result in run_on_ranks(world, _llama_on_rank, setting, dp, timeout=150):
        assert result["grad_scale"] > 1e-3  # the comparison is not vacuous
        assert result["loss"] < MODEL_TOL and result["grads"] < MODEL_TOL, result
        assert (result["compiled_calls"] > 0) == ("compile" in setting), result


def _saved_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter tensors autograd saves in one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    return sum(seen.values())


def _activation_ratio_on_rank() -> float:
    tokens = _tokens(2)[:, :-1]
    model = _llama()
    whole = _saved_bytes(model, tokens)
    with context_parallel(dist.group.WORLD) as cp:
        return _saved_bytes(model, cp.shard(tokens)) / whole


@pytest.mark.parametrize("world", [2, 4])
def test_activations_saved_per_rank_fall_as_one_over_cp(world):
    for ratio in run_on_ranks(world, _activation_ratio_on_rank, timeout=60):
        assert ratio < 1.05 / world, ratio


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
    from hyper_parallel.context_parallel import document_ids

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


def test_document_ids_start_a_document_after_each_eos():
    from hyper_parallel.context_parallel import document_ids

    assert document_ids(torch.tensor([[5, 1, 0, 3, 0, 0, 4]]), 0).tolist() == [[0, 0, 0, 1, 1, 2, 3]]
    with pytest.raises(ValueError, match="documents must be .batch, sequence. integer ids, got torch.float32"):
        with context_parallel(dist.group.WORLD, documents=torch.zeros(2, 4)):
            pass


# --------------------------------------------------------------------------- the docs' example


def _docs_snippet_on_rank(code: str) -> dict:
    """Run docs/fully_shard.md's long-context snippet as written; its loss and that of the same
    model on the whole batch in this process (the snippet's dp is 1 on 2 ranks)."""
    scope: dict = {}
    exec(compile(code, "docs/fully_shard.md", "exec"), scope)  # noqa: S102 - the docs' own example
    model, inputs, labels = scope["model"], scope["inputs"], scope["labels"]
    reference = build_llama("llama_debug", max_seq_len=64)
    reference.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
    expected = F.cross_entropy(reference(inputs).flatten(0, 1), labels.flatten())
    share = scope["loss"].detach().clone()
    dist.all_reduce(share, op=dist.ReduceOp.AVG)
    grads = all(p.grad is not None for p in model.parameters())
    return {"loss": share.item(), "expected": expected.item(), "grads": grads}


def test_the_long_context_snippet_of_the_docs_runs_as_written():
    import os
    import re

    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "fully_shard.md")) as f:
        section = f.read().split("## Long context (context parallelism)", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    for result in run_on_ranks(2, _docs_snippet_on_rank, code, timeout=60):
        assert result["grads"] and abs(result["loss"] - result["expected"]) < 1e-5, result
