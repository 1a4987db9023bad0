"""Inputs torch's fully_shard rejects and ours accepts on purpose train exactly (float64 parity
on 2 gloo ranks against the single-process model on the global batch)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import hyper_parallel as hp
from tests.fully_shard._helpers import DTYPE, TOL, VOCAB, parity
from tests.multirank import run_on_ranks


def _conv_model() -> nn.Module:
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Flatten(), nn.Linear(16, 3)).to(DTYPE)
    model = model.to(memory_format=torch.channels_last)
    assert not model[0].weight.is_contiguous()  # torch: "FSDP does not support non-contiguous parameters"
    return model


def _conv_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    images = (tokens[:, :8].to(DTYPE) / VOCAB).repeat(1, 4).view(-1, 2, 4, 4)
    return model(images).pow(2).mean()


def _channels_last_parity() -> float:
    def wrap(model):
        hp.fully_shard(model[0])
        return hp.fully_shard(model)
    return parity(wrap, dist.get_rank(), dist.get_world_size(), model_fn=_conv_model,
                  loss_fn=_conv_loss)


def test_channels_last_parameters_train_exactly():
    for diff in run_on_ranks(2, _channels_last_parity, timeout=120):
        assert diff <= TOL, diff
