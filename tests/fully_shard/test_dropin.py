"""FSDP2 drop-in behaviours (CPU ports of torch's FSDP2 unit tests' checks), in float64."""

from __future__ import annotations

import copy
import functools
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import hyper_parallel as hp
from hyper_parallel.core.fully_shard import collectives
from tests.fully_shard._helpers import DTYPE, TOL, full_params, global_batch, max_diff, parity
from tests.multirank import run_on_ranks

DIM, HIDDEN = 6, 5  # HIDDEN is odd: uneven shards on either dim over 2 ranks


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(DIM, HIDDEN)
        self.out_proj = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.out_proj(torch.relu(self.in_proj(x)))


def _mlp() -> nn.Module:
    return _MLP().to(DTYPE)


def _mse_of_scaled_tokens(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    x = tokens.to(DTYPE) / 32
    return ((model(x[:, :DIM]) - x[:, -DIM:]) ** 2).mean()


def _wrap_mlp(model: nn.Module, **kw) -> nn.Module:
    hp.fully_shard(model.in_proj, **kw)
    hp.fully_shard(model.out_proj, **kw)
    return hp.fully_shard(model, **kw)


# -- shard_placement_fn: local shards and their grads are contiguous on any dim -----------------
def _contiguous_shards_on_dim_gt0():
    results = {}
    for name, fn in [("shard1", lambda p: Shard(1) if p.ndim > 1 else Shard(0)),
                     ("shard_minus1", lambda p: Shard(-1))]:
        def wrap(model, fn=fn):
            model = _wrap_mlp(model, shard_placement_fn=fn)
            for pname, param in model.named_parameters():
                assert param.is_contiguous() and param.to_local().is_contiguous(), pname
            return model

        collectives.reset_collective_counts()
        results[name] = parity(wrap, dist.get_rank(), 2, model_fn=_mlp, loss_fn=_mse_of_scaled_tokens)
        # 2 steps of 2 non-empty groups (the root holds none): per step each all-gathers in
        # forward and again in backward, and reduce-scatters once.
        counts = collectives.collective_counts()
        assert counts == {"all_gather": 8, "reduce_scatter": 4}, counts

    torch.manual_seed(0)
    model = _wrap_mlp(_mlp(), shard_placement_fn=lambda p: Shard(p.ndim - 1))
    _mse_of_scaled_tokens(model, global_batch(0)).backward()
    for pname, param in model.named_parameters():
        assert param.to_local().is_contiguous(), pname
        assert param.grad.is_contiguous() and param.grad.to_local().is_contiguous(), pname
    return results


def test_shard_placement_fn_contiguous_params_grads():
    for result in run_on_ranks(2, _contiguous_shards_on_dim_gt0, timeout=180):
        assert all(v <= TOL for v in result.values()), result


# -- instrumentation that patches torch.distributed sees fully_shard's collectives --------------
def _patched_collectives_are_seen():
    seen = {"all_gather": 0, "reduce_scatter": 0}
    real_all_gather, real_reduce_scatter = dist.all_gather_single, dist.reduce_scatter_single

    def all_gather(*args, **kwargs):
        seen["all_gather"] += 1
        return real_all_gather(*args, **kwargs)

    def reduce_scatter(*args, **kwargs):
        seen["reduce_scatter"] += 1
        return real_reduce_scatter(*args, **kwargs)

    torch.manual_seed(0)
    model = _wrap_mlp(_mlp())
    # What torch.testing._internal.common_fsdp's patch_all_gather / patch_reduce_scatter do.
    with mock.patch.object(dist, "all_gather_single", all_gather), \
            mock.patch.object(dist, "reduce_scatter_single", reduce_scatter):
        _mse_of_scaled_tokens(model, global_batch(0)).backward()
    return seen


def test_patched_torch_collectives_see_our_calls():
    for seen in run_on_ranks(2, _patched_collectives_are_seen, timeout=120):
        assert seen == {"all_gather": 4, "reduce_scatter": 2}, seen


# -- world size 1: no collectives -------------------------------------------------------------
def _world_size_one():
    assert dist.get_world_size() == 1
    collectives.reset_collective_counts()
    diffs = {"fsdp": parity(_wrap_mlp, 0, 1, model_fn=_mlp, loss_fn=_mse_of_scaled_tokens),
             "dim1": parity(lambda m: _wrap_mlp(m, shard_placement_fn=lambda p: Shard(p.ndim - 1)),
                            0, 1, model_fn=_mlp, loss_fn=_mse_of_scaled_tokens, micro_batches=2)}
    return diffs, collectives.collective_counts()


def test_train_parity_single_worldsize1():
    [(diffs, counts)] = run_on_ranks(1, _world_size_one, timeout=120)
    assert all(v <= TOL for v in diffs.values()), diffs
    assert counts == {}, counts


def _train_both_on_mse(reference: nn.Module, model: nn.Module, steps: int, before_step=None, opt_fn=None) -> float:
    """AdamW steps of the reference on the global batch and of the wrapped model on this rank's
    half; ``before_step(model, step)`` runs on both first. Max abs diff of the full parameters."""
    opt_fn = opt_fn or (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1))
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizers = [opt_fn(reference), opt_fn(model)]
    for step in range(steps):
        batch = global_batch(step)
        for m, opt, data in ((reference, optimizers[0], batch), (model, optimizers[1], batch.chunk(world)[rank])):
            if before_step is not None:
                before_step(m, step)
            _mse_of_scaled_tokens(m, data).backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
    return max_diff(full_params(model), full_params(reference))


# -- module.to(dtype) after fully_shard -------------------------------------------------------
def _to_float64_after_init():
    torch.manual_seed(0)
    reference = _MLP().to(DTYPE)  # float32 values: exact in either dtype
    model = _wrap_mlp(copy.deepcopy(reference).float())
    model.to(DTYPE)
    with torch.no_grad():
        model(torch.zeros(1, DIM, dtype=DTYPE))  # lazy init in float64 ...
    model.float().to(DTYPE)  # ... and convert again after it
    for name, param in model.named_parameters():
        assert param.dtype == param.to_local().dtype == param._spec.tensor_meta.dtype == DTYPE, name
    diff = _train_both_on_mse(reference, model, steps=3)
    for name, param in model.named_parameters():
        assert param.to_local().dtype == DTYPE and param.grad is None, name
    _mse_of_scaled_tokens(model, global_batch(0)).backward()
    for name, param in model.named_parameters():
        assert param.grad.to_local().dtype == param.grad._spec.tensor_meta.dtype == DTYPE, name
    return diff


def test_to_float64_after_init():
    for diff in run_on_ranks(2, _to_float64_after_init, timeout=120):
        assert diff <= TOL, diff


# -- requires_grad_ changed after wrapping ----------------------------------------------------
def _linears() -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [nn.Linear(DIM, DIM), nn.ReLU()]
    return nn.Sequential(*layers).to(DTYPE)


def _set_frozen(model: nn.Module, step: int) -> None:
    """model[0] and model[4] (linears) frozen in steps 0-1 (after wrapping), trainable again from step 2."""
    for i in (0, 4):
        model[i].requires_grad_(step >= 2)


def _mixed_requires_grad_across_groups():
    reference = _linears()
    model = copy.deepcopy(reference)
    for module in model:
        if isinstance(module, nn.Linear):
            hp.fully_shard(module, reshard_after_forward=False)
    hp.fully_shard(model)
    # AdamW moves a parameter with a gradient even if it is zero and skips one without: a
    # frozen parameter that got a gradient, or an unfrozen one that did not, breaks parity.
    diff = _train_both_on_mse(reference, model, steps=3, before_step=_set_frozen)
    _set_frozen(model, 0)
    _mse_of_scaled_tokens(model, global_batch(0)).backward()
    has_grad = {name: p.grad is not None for name, p in model.named_parameters()}
    return diff, has_grad


def test_train_mixed_requires_grad_across_groups():
    frozen = {"0.weight", "0.bias", "4.weight", "4.bias"}
    for diff, has_grad in run_on_ranks(2, _mixed_requires_grad_across_groups, timeout=120):
        assert diff <= TOL, diff
        assert has_grad == {n: n not in frozen for n in has_grad}, has_grad


# -- post-accumulate-grad hooks on sharded parameters -----------------------------------------
def _post_accumulate_grad_hooks():
    torch.manual_seed(0)
    reference = _mlp()
    model = _wrap_mlp(copy.deepcopy(reference))
    calls = []

    def hook(name, param):
        calls.append((name, isinstance(param.grad, DTensor) and param.grad.shape == param.shape))

    for name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(functools.partial(hook, name))
    _mse_of_scaled_tokens(model, global_batch(0)).backward()
    names = [name for name, _ in model.named_parameters()]

    # Optimizer in backward: one AdamW per parameter, stepped by its hook.
    model = _wrap_mlp(copy.deepcopy(reference))
    optimizers = {p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1) for p in model.parameters()}

    def step_in_backward(param):
        optimizers[param].step()
        optimizers[param].zero_grad()

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(step_in_backward)
    diff = _train_both_on_mse(reference, model, steps=3,
                       opt_fn=lambda m: None if m is model else torch.optim.AdamW(
                           m.parameters(), lr=1e-2, weight_decay=0.1))
    return sorted(calls), sorted((n, True) for n in names), diff


def test_post_acc_grad_hook_runs_and_optim_in_backward_parity():
    for calls, expected, diff in run_on_ranks(2, _post_accumulate_grad_hooks, timeout=120):
        assert calls == expected, calls  # once per parameter, with the reduced sharded grad
        assert diff <= TOL, diff


# -- parameters replaced after wrapping, before the first forward -----------------------------
class _WeightNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(DIM, DIM, bias=False)
        self.layer2 = nn.Linear(DIM, DIM, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(DIM))

    def init_weight_norm(self):
        with torch.no_grad():
            norm = torch.linalg.norm(self.layer1.weight, dim=1) + torch.linalg.norm(self.layer2.weight, dim=1)
        self.weight_norm = nn.Parameter(norm)

    def forward(self, x):
        return self.layer2(self.layer1(x)) * self.weight_norm


def _reset_sharded_param_in_lazy_init():
    torch.manual_seed(0)
    reference = _WeightNorm().to(DTYPE)
    reference.init_weight_norm()
    with torch.device("meta"):
        model = _WeightNorm().to(DTYPE)
    hp.fully_shard(model.layer1)
    hp.fully_shard(model.layer2)
    hp.fully_shard(model)
    for name in ("layer1", "layer2"):
        getattr(model, name).to_empty(device="cpu")
        getattr(model, name).load_state_dict(getattr(reference, name).state_dict())
    model.init_weight_norm()  # a new DTensor parameter replaces the (meta) sharded one
    results = {"weight_norm": _train_both_on_mse(reference, model, steps=3)}

    # load_state_dict(assign=True) (full tensors) into a meta-built wrapped model, and a
    # DTensor parameter assigned to a wrapped module's attribute.
    torch.manual_seed(0)
    reference = _mlp()
    with torch.device("meta"):
        model = _wrap_mlp(_mlp())
    model.load_state_dict(reference.state_dict(), assign=True)
    bias = torch.linspace(-1, 1, HIDDEN, dtype=DTYPE)
    reference.in_proj.bias = nn.Parameter(bias)
    old = model.in_proj.bias
    model.in_proj.bias = nn.Parameter(distribute_tensor(bias, old.device_mesh, old.placements))
    results["assign"] = _train_both_on_mse(reference, model, steps=3)
    assert all(isinstance(p, DTensor) and not p.is_meta for p in model.parameters())

    # A plain tensor cannot become the sharded parameter without orphaning its optimizer.
    model.in_proj.bias = nn.Parameter(bias.clone())
    try:
        model(torch.zeros(1, DIM, dtype=DTYPE))
    except ValueError as err:
        results["plain_error"] = 0.0 if "replaced by a plain tensor" in str(err) else 1.0
    return results


def test_reset_sharded_param_in_lazy_init():
    for result in run_on_ranks(2, _reset_sharded_param_in_lazy_init, timeout=120):
        assert set(result) == {"weight_norm", "assign", "plain_error"}, result
        assert all(v <= TOL for v in result.values()), result
