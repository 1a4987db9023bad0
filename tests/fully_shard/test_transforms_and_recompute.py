"""Drop-in behaviours found by torch's FSDP2 tests (tools/CONFORMANCE.md): the meta-device error
names the parameters, a first forward inside ``torch.func.jvp`` works, and activation-checkpoint
recomputation casts outputs to ``output_dtype`` like the original forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import hyper_parallel as hp
from tests.multirank import run_on_ranks


def _meta_error() -> str:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    hp.fully_shard(model[0])
    hp.fully_shard(model[1])
    hp.fully_shard(model)
    model[1].to_empty(device="cpu")  # model[0] is left on meta
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(2, 8))
    return str(info.value)


def test_meta_device_error_names_the_parameters_left_on_meta():
    for message in run_on_ranks(2, _meta_error, timeout=120):
        assert "still on meta device: ['0.weight', '0.bias']" in message, message


def _jvp_first_forward() -> tuple:
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.float64, reduce_dtype=torch.float64)
    torch.manual_seed(0)
    enc, dec = nn.Linear(16, 32, bias=False), nn.Linear(32, 24, bias=False)
    reference = dec.weight.detach().double() @ (enc.weight.detach().double() @ torch.ones(16, dtype=torch.float64))
    for module in (enc, dec):
        hp.fully_shard(module, mp_policy=policy, reshard_after_forward=False)
    x = torch.ones(16, dtype=torch.float64)
    primal = torch.randn(24, dtype=torch.float64, requires_grad=True)
    hidden = enc(x)  # dec's first forward (lazy init, all-gather) runs inside the transform
    output, tangent = torch.func.jvp(lambda _: dec(hidden), (primal,), (torch.randn(24, dtype=torch.float64),))
    return (output.detach() - reference).abs().max().item(), tangent.abs().max().item(), output.dtype


def test_first_forward_inside_jvp():
    for diff, tangent, dtype in run_on_ranks(2, _jvp_first_forward, timeout=120):
        assert dtype == torch.float64
        assert diff < 1e-12 and tangent == 0.0  # dec(hidden) does not depend on the primal


class _CheckpointedBf16Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(1, 1)
        self.output_dtypes: list = []

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        self.output_dtypes.append(x.dtype)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._inner, x.to(torch.bfloat16), use_reentrant=False, early_stop=False).float().sum()


def _recompute_dtypes() -> list:
    policy = hp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                     output_dtype=torch.float32, cast_forward_inputs=False)
    torch.manual_seed(0)
    model = _CheckpointedBf16Linear()
    hp.fully_shard(model.linear, mp_policy=policy)
    hp.fully_shard(model, mp_policy=policy)
    model(torch.randn(8, 1)).backward()
    return model.output_dtypes


def test_checkpoint_recompute_casts_outputs_like_the_forward():
    for dtypes in run_on_ranks(2, _recompute_dtypes, timeout=120):
        assert dtypes == [torch.float32, torch.float32]  # forward, then recomputation
