"""hp.clip_grad_norm_ on an FSDP+TP model (biases included) against torch's on the single-process model."""

from __future__ import annotations

import pytest

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import hyper_parallel as hp
from tests.fully_shard._helpers import lm_loss
from tests.multirank import run_on_ranks

VOCAB, DIM, HIDDEN, SEQ = 24, 8, 12, 6


class _Block(nn.Module):
    """Feature-wise (TP-safe) attention-like mixing and an MLP, every linear with a bias."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.wo(torch.tanh(self.wq(h)) * self.wk(h) + self.wv(h))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class _TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


_PLAN = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(),
         "fc1": ColwiseParallel(), "wo": RowwiseParallel(), "fc2": RowwiseParallel()}


def _fsdp_tp_norms(norm_type: float):
    """Total norms and clipped gradients of three steps, wrapped vs. single-process, in float64."""
    torch.manual_seed(0)
    reference = _TinyLM().double()
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = copy.deepcopy(reference)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], _PLAN)
        hp.fully_shard(block, mesh=mesh["dp"])
    hp.fully_shard(model, mesh=mesh["dp"])
    dp_rank = mesh["dp"].get_local_rank()
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, model)]
    norm_diffs, grad_diffs, norms = [], [], []
    for step in range(3):
        tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(step))
        lm_loss(reference, tokens).backward()
        lm_loss(model, tokens.chunk(2)[dp_rank]).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.3, norm_type)
        norm = hp.clip_grad_norm_(model.parameters(), 0.3, norm_type)
        norms.append(ref_norm.item())
        norm_diffs.append(abs(norm.item() - ref_norm.item()) / ref_norm.item())
        ref_grads = dict(reference.named_parameters())
        grad_diffs.append(max(
            (p.grad.full_tensor() - ref_grads[name].grad).abs().max().item()
            for name, p in model.named_parameters()))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert dist.get_world_size() == 4
    return norms, norm_diffs, grad_diffs


@pytest.mark.slow  # FSDP x TP norms: the tests above
def test_fsdp_tp_with_biases_norm_matches_torch():
    for norm_type in (2.0, math.inf):
        for norms, norm_diffs, grad_diffs in run_on_ranks(4, _fsdp_tp_norms, norm_type, timeout=180):
            assert max(norm_diffs) <= 1e-12, (norm_type, norms, norm_diffs)
            assert max(grad_diffs) <= 1e-12, (norm_type, grad_diffs)
