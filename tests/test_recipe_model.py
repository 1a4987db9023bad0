"""The recipe's parallelize step reads what a model declares as a ``RecipeModel``, whatever its
class: a model that is neither the project's decoder nor a ``transformers`` one is initialised
through ``init_from_seed`` and checkpointed as its ``replays_routing`` flag says."""

from __future__ import annotations

from typing import List

import pytest
import torch
from torch import nn

from hyper_parallel.models import RecipeModel
from hyper_parallel.trainer.config.model import ModelConfig
from hyper_parallel.trainer.setup.parallelize import parallelize


class TwoLinears(nn.Module, RecipeModel):
    """A model of another kind: two linear blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(4, 4) for i in range(2)})
        self.seeds: List[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return x

    def apply_tensor_parallel(self, tp_mesh) -> None:
        raise ValueError("no plan")

    def init_from_seed(self, seed: int) -> None:
        self.seeds.append(seed)
        torch.manual_seed(seed)
        for layer in self.layers.values():
            layer.reset_parameters()


class RoutedLinears(TwoLinears):
    replays_routing = True


@pytest.mark.parametrize("model_class, wrapper", [(TwoLinears, "_checkpointed."),
                                                   (RoutedLinears, "_checkpointed_replaying_routing.")])
def test_parallelize_reads_the_models_declared_contract(model_class, wrapper):
    with torch.device("meta"):
        model = model_class()
    parallelize(model, ModelConfig(activation_checkpointing=True), mesh=None, device=torch.device("cpu"), seed=5)
    assert model.seeds == [5]
    torch.manual_seed(5)
    expected = [nn.Linear(4, 4).weight for _ in range(2)]  # reset_parameters draws as the constructor does
    assert all(torch.equal(layer.weight, w) for layer, w in zip(model.layers.values(), expected))
    assert all(layer.forward.__qualname__.startswith(wrapper) for layer in model.layers.values())
    x = torch.randn(3, 4, requires_grad=True)
    model(x).sum().backward()  # the checkpointed blocks run forward and backward
    assert x.grad is not None
