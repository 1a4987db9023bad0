"""Context parallelism (hyper_parallel.parallel.context): sequence layouts, the context and its
errors, the token loss, and the Llama model under CP, exact against one process (the ring
attention itself: tests/test_ring_attention.py).

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
from hyper_parallel.models import build_llama
from hyper_parallel.models.llama_parallel import apply_tensor_parallel
from hyper_parallel.parallel.context import (Layout, context_parallel, current_context, document_ids,
                                             mean_token_loss, rope_rows, sequence_positions, shard_sequence,
                                             token_loss_scale)
from hyper_parallel.parallel.ring_attention import cp_attention
from hyper_parallel.parallel.tensor import loss_parallel
from tests.fully_shard._helpers import CountingBackend
from tests.multirank import run_on_ranks
from tests.test_ring_attention import D64, TOL, _qkv, _sdpa

MODEL_TOL = 1e-10  # a 2-block model: more operations between the noise and the result


# --------------------------------------------------------------------------- one process


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
    from hyper_parallel.trainer.setup.context_parallel import dp_cp_mesh
    from hyper_parallel.trainer.setup.parallelize import apply_activation_checkpointing

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


def test_document_ids_start_a_document_after_each_eos():
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
