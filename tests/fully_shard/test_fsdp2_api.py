"""FSDP2 API a drop-in user calls: fully_shard([a, b]), register_fsdp_forward_method, the
FSDPModule setters, reset_iter_state, and bad-argument errors.

Parity runs in float64 against single-process training on the global batch (see
[Note: parity in float64] in _helpers.py).
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import hyper_parallel as hp
from hyper_parallel.core.fully_shard import collectives
from tests.fully_shard._helpers import (TOL, full_params, global_batch, lm_loss, max_diff, shard_layers_and_root,
                                        tiny_llama, train)
from tests.multirank import run_on_ranks


def _pair(seed: int = 0, model_fn=tiny_llama):
    """A reference model and a deep copy to be wrapped."""
    torch.manual_seed(seed)
    reference = model_fn()
    return reference, copy.deepcopy(reference)


def _local(batch: torch.Tensor) -> torch.Tensor:
    return batch.chunk(dist.get_world_size())[dist.get_rank()]


def _train_both(reference, model, steps=2, micro_batches=1, before_micro=None) -> float:
    """Train both (the model on this rank's slice); ``before_micro`` runs on the model only."""
    batches = [global_batch(s) for s in range(steps)]
    train(reference, batches, micro_batches=micro_batches)
    train(model, [_local(b) for b in batches], micro_batches=micro_batches, before_micro=before_micro)
    return max_diff(full_params(model), full_params(reference))


def _step_counts(model) -> dict:
    collectives.reset_collective_counts()
    lm_loss(model, _local(global_batch(9))).backward()
    counts = collectives.collective_counts()
    model.zero_grad()
    return counts


def _assert_within(results, tol=TOL):
    for result in results:
        bad = {k: v for k, v in result.items() if not v <= tol}
        assert not bad, bad


# -- fully_shard([a, b]) ------------------------------------------------------------------
def _group_of_modules():
    reference, model = _pair()
    group = hp.fully_shard([model.norm, model.output])
    assert group[0] is model.norm and isinstance(model.output, hp.FSDPModule)
    assert model.norm._state is model.output._state  # one parameter group
    shard_layers_and_root(model)
    seen = []
    model.output.register_forward_pre_hook(lambda m, _: seen.append(isinstance(m.weight, DTensor)))
    model.norm.register_forward_hook(lambda m, *_: seen.append(isinstance(m.weight, DTensor)))
    results = {"parity": _train_both(reference, model)}
    # One all-gather per pass for the norm+head group: 2 per block, 2 for the group, 1 for
    # the root (kept unsharded for backward); one reduce-scatter per group.
    counts = _step_counts(model)
    assert counts == {"all_gather": 7, "reduce_scatter": 4}, counts
    assert not any(seen), seen  # unsharded between norm and head: no reshard in between
    with torch.no_grad():
        model(_local(global_batch(0))[:, :-1])
    assert isinstance(model.norm.weight, DTensor) and isinstance(model.output.weight, DTensor)
    return results


def test_fully_shard_list_is_one_group():
    _assert_within(run_on_ranks(2, _group_of_modules, timeout=180))


def _group_with_head_called_later():
    """Chunked loss: the model's forward runs only norm; the head runs per chunk afterwards."""
    class Trunk(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, tokens):
            h = self.inner.tok_embeddings(tokens)
            for layer in self.inner.layers.values():
                h = layer(h, self.inner.rope_cos, self.inner.rope_sin)
            return self.inner.norm(h)

    def chunked_loss(trunk, tokens):
        h = trunk(tokens[:, :-1])
        targets = tokens[:, 1:]
        losses = [F.cross_entropy(trunk.inner.output(hc).flatten(0, 1), tc.flatten(), reduction="sum")
                  for hc, tc in zip(h.chunk(2, dim=1), targets.chunk(2, dim=1))]
        return sum(losses) / targets.numel()

    torch.manual_seed(0)
    reference = Trunk(tiny_llama())
    model = copy.deepcopy(reference)
    hp.fully_shard([model.inner.norm, model.inner.output])
    for layer in model.inner.layers.values():
        hp.fully_shard(layer)
    hp.fully_shard(model)
    batches = [global_batch(s) for s in range(2)]
    train(reference, batches, loss_fn=chunked_loss)
    train(model, [_local(b) for b in batches], loss_fn=chunked_loss)
    return {"parity": max_diff(full_params(model), full_params(reference))}


def test_fully_shard_list_head_called_after_root_forward():
    _assert_within(run_on_ranks(2, _group_with_head_called_later, timeout=180))


def _list_groupings():
    """Groupings torch's FSDP2 tests use: two blocks in one group, a tied embedding + head
    in one group, and an embedding group that is not unsharded in backward."""
    def blocks_together(model):
        hp.fully_shard(list(model.layers.values()))
        return hp.fully_shard(model)

    def tied_embedding_and_head(model):
        hp.fully_shard([model.tok_embeddings, model.output])
        return shard_layers_and_root(model)

    def embedding_group_no_backward_unshard(model):
        hp.fully_shard([model.tok_embeddings])
        model.tok_embeddings.set_unshard_in_backward(False)
        hp.fully_shard([model.norm, model.output])
        return shard_layers_and_root(model)

    results = {}
    for wrap, tie in ((blocks_together, False), (tied_embedding_and_head, True),
                      (embedding_group_no_backward_unshard, False)):
        reference, model = _pair(model_fn=lambda: tiny_llama(tie_embeddings=tie))
        wrap(model)
        results[wrap.__name__] = _train_both(reference, model)
    return results


def test_fully_shard_list_groupings():
    _assert_within(run_on_ranks(2, _list_groupings, timeout=240))


# -- register_fsdp_forward_method ---------------------------------------------------------
class _Scorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return self.proj(x)

    def generate(self, x):
        return self.proj(x) * self.scale  # reads a root parameter directly, not through forward


def _forward_method():
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _Scorer().double()
    model = copy.deepcopy(reference)
    hp.fully_shard(model.proj)
    hp.fully_shard(model)
    hp.register_fsdp_forward_method(model, "generate")
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = model.generate(x.chunk(world)[rank])
    out.pow(2).mean().backward()
    expected = reference.generate(x)
    expected.pow(2).mean().backward()
    results = {"output": (out - expected.chunk(world)[rank]).abs().max().item()}
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    results["grads"] = max_diff(grads, {n: p.grad for n, p in reference.named_parameters()})
    plain = nn.Linear(2, 2)
    hp.register_fsdp_forward_method(plain, "nothing_here")  # not an FSDPModule: no-op
    with pytest.raises(ValueError, match="no method 'missing'"):
        hp.register_fsdp_forward_method(model, "missing")
    return results


def test_register_fsdp_forward_method():
    _assert_within(run_on_ranks(2, _forward_method, timeout=120))


# -- setters ------------------------------------------------------------------------------
def _reshard_after_forward():
    reference, model = _pair()
    shard_layers_and_root(model)
    default = _step_counts(model)
    model.set_reshard_after_forward(True, recurse=False)  # the root too: re-gathered in backward
    root_resharded = _step_counts(model)
    model(_local(global_batch(0))[:, :-1])
    root_sharded_after_forward = isinstance(model.norm.weight, DTensor)
    model.reshard()
    model.set_reshard_after_forward(False)  # every group keeps its parameters until backward
    kept = _step_counts(model)
    with pytest.raises(ValueError, match="bool"):
        model.set_reshard_after_forward(2)
    results = {"parity": _train_both(reference, model)}
    return results, default, root_resharded, root_sharded_after_forward, kept


def test_set_reshard_after_forward():
    for results, default, root_resharded, root_sharded, kept in run_on_ranks(
            2, _reshard_after_forward, timeout=180):
        _assert_within([results])
        assert default["all_gather"] == 5 and root_resharded["all_gather"] == 6, (default, root_resharded)
        assert root_sharded
        assert kept["all_gather"] == 3, kept


def _divide_factor():
    world = dist.get_world_size()
    reference, model = _pair()
    shard_layers_and_root(model)
    modules = [m for m in model.modules() if isinstance(m, hp.FSDPModule)]
    for module in modules:
        module.set_gradient_divide_factor(1.0)  # sum over ranks
    batch = global_batch(0)
    lm_loss(model, _local(batch)).backward()
    lm_loss(reference, batch).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    summed = {n: world * p.grad for n, p in reference.named_parameters()}
    results = {"sum": max_diff(grads, summed)}
    model.zero_grad()
    for module in modules:
        module.set_gradient_divide_factor(4.0 * world)
    lm_loss(model, _local(batch)).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    results["quarter_mean"] = max_diff(grads, {n: p.grad / 4 for n, p in reference.named_parameters()})
    for bad in (0, -1.0, "2"):
        with pytest.raises(ValueError, match="positive"):
            model.set_gradient_divide_factor(bad)
    return results


def test_set_gradient_divide_factor():
    _assert_within(run_on_ranks(2, _divide_factor, timeout=120))


def _unshard_in_backward():
    reference, model = _pair()
    hp.fully_shard(model.tok_embeddings)
    shard_layers_and_root(model)
    default = _step_counts(model)
    model.tok_embeddings.set_unshard_in_backward(False)  # its weight gradient needs only the ids
    skipped = _step_counts(model)
    return {"parity": _train_both(reference, model)}, default, skipped


def test_set_unshard_in_backward():
    for results, default, skipped in run_on_ranks(2, _unshard_in_backward, timeout=180):
        _assert_within([results])
        assert default == {"all_gather": 7, "reduce_scatter": 4}, default
        assert skipped == {"all_gather": 6, "reduce_scatter": 4}, skipped


def _is_last_backward():
    reference, model = _pair()
    shard_layers_and_root(model)
    in_flight_after_first = []

    def before_micro(m, i, n):
        if i == 1:  # after micro-batch 0's backward: the root group (reduced last) still in flight
            in_flight_after_first.append(m.norm.weight.grad is None and m.layers["0"].attention.wq.weight.grad is not None)
        m.set_is_last_backward(i == n - 1)

    results = {"parity": _train_both(reference, model, micro_batches=2, before_micro=before_micro)}
    return results, in_flight_after_first


def test_set_is_last_backward():
    for results, in_flight in run_on_ranks(2, _is_last_backward, timeout=180):
        _assert_within([results])
        assert in_flight == [True, True], in_flight


def _reset_iter_state():
    reference, model = _pair()
    shard_layers_and_root(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    fail = {"where": None}

    def fail_forward(*_):
        if fail["where"] == "forward":
            raise RuntimeError("injected forward failure")

    def fail_backward(grad):
        if fail["where"] == "backward":
            raise RuntimeError("injected backward failure")
        return grad

    def hook_output(module, args, output):
        output.register_hook(fail_backward)

    model.layers["1"].register_forward_pre_hook(fail_forward)
    model.layers["0"].register_forward_hook(hook_output)
    step = 0
    for where in (None, "backward", None, "forward", None):
        fail["where"] = where
        batch = global_batch(step)
        try:
            lm_loss(model, _local(batch)).backward()
        except RuntimeError as error:
            assert "injected" in str(error)
            model.reset_iter_state()
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
        lm_loss(reference, batch).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        step += 1
    with pytest.raises(RuntimeError, match="root"):
        model.layers["0"].reset_iter_state()
    return {"parity": max_diff(full_params(model), full_params(reference))}


def test_reset_iter_state_recovers_after_exception():
    _assert_within(run_on_ranks(2, _reset_iter_state, timeout=180))


# -- .to(dtype) while unsharded ----------------------------------------------------------
def _to_dtype_while_unsharded():
    reference, model = _pair(model_fn=lambda: tiny_llama(dtype=torch.float32))
    reference.double()  # float32 values: exact in float64 too
    shard_layers_and_root(model)
    model.unshard()  # the root group's unsharded parameters are the registered ones now
    model.layers["0"].unshard()
    model.to(torch.float64)  # converts the sharded parameters (each group reshards first)
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.to_local().dtype == torch.float64, name
    return {"to_float64": _train_both(reference, model)}


def test_to_dtype_while_unsharded():
    _assert_within(run_on_ranks(2, _to_dtype_while_unsharded, timeout=180))


# -- MixedPrecisionPolicy(param_dtype_override_fn=...) -----------------------------------
class _ScaledProj(_Scorer):
    def forward(self, x):
        return self.proj(x) * self.scale  # elementwise: float32 activations * float64 scale


def _param_dtype_override():
    torch.manual_seed(0)
    reference = _ScaledProj().double()
    model = copy.deepcopy(reference)
    keep = {id(model.scale)}
    hp.fully_shard(model, mp_policy=hp.MixedPrecisionPolicy(
        param_dtype=torch.float32, param_dtype_override_fn=lambda p: torch.float64 if id(p) in keep else None))
    seen = {}
    model.proj.register_forward_pre_hook(
        lambda m, _: seen.update(weight=m.weight.dtype, scale=model.scale.dtype))
    x = _local(torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    out = model(x)
    # The same casts by hand, on the same rows: the same kernels, so the same bits.
    proj = reference.proj
    expected = F.linear(x.float(), proj.weight.float(), proj.bias.float()) * reference.scale
    out.sum().backward()
    grad_dtypes = {n: p.grad.dtype for n, p in model.named_parameters()}
    return seen, (out - expected).abs().max().item(), grad_dtypes, out.dtype


def test_param_dtype_override_fn():
    for seen, diff, grad_dtypes, out_dtype in run_on_ranks(2, _param_dtype_override, timeout=120):
        assert seen == {"weight": torch.float32, "scale": torch.float64}, seen
        assert diff == 0 and out_dtype == torch.float64, (diff, out_dtype)
        assert set(grad_dtypes.values()) == {torch.float64}, grad_dtypes  # master weights' dtype


# -- errors and docs (no process group needed) --------------------------------------------
@pytest.mark.parametrize("bad, got", [
    (torch.randn(3), "got Tensor"),
    ([nn.Linear(2, 2), torch.randn(3)], "list holding Tensor"),
    ([], "empty list"),
    ("model", "got str"),
])
def test_fully_shard_rejects_non_modules(bad, got):
    with pytest.raises(TypeError, match="module") as info:
        hp.fully_shard(bad)
    assert got in str(info.value)


def test_fully_shard_rejects_containers_without_forward():
    with pytest.raises(ValueError, match="ModuleList"):
        hp.fully_shard(nn.ModuleList([nn.Linear(2, 2)]))


def test_every_hp_name_in_fully_shard_docs_exists():
    # A fresh interpreter: here other imports (hyper_parallel.models by the test helpers)
    # already made submodules attributes of the package.
    text = (Path(__file__).resolve().parents[2] / "docs" / "fully_shard.md").read_text()
    names = sorted(set(re.findall(r"\bhp\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)", text)))
    assert "models.build_llama" in names and "register_fsdp_forward_method" in names, names
    code = "import sys, functools, hyper_parallel as hp\n" \
           "for name in sys.argv[1:]: functools.reduce(getattr, name.split('.'), hp)"
    proc = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
