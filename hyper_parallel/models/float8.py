"""``training.float8``: torchao float8 linears (optional ``hyper_parallel[float8]`` extra).

``tensorwise`` (dynamic, one scale per tensor) gathers the weights in float8 through
fully_shard's all-gather extension and computes all weights' scales with one all-reduce after
the optimizer step; ``rowwise`` (one scale per row, more accurate, slower) gathers in the
compute dtype. The output layer (``output``; a ``transformers`` model's ``lm_head``), a
mixture of experts' routers (``router.gate``; ``mlp.gate``: their choice of experts is
sensitive to rounding), ``nn.Linear`` subclasses (their own forward) and linears whose dims
float8 matmuls cannot take (not multiples of 16) stay in high precision, as torchtitan filters
them (docs/recipes.md). A mixture of experts' routed experts are grouped 3-D weights, not
linears: they stay in high precision.
"""

from __future__ import annotations

import dataclasses
from typing import List, Union

import torch
from torch import nn

from hyper_parallel._optional import MissingDependency, require
from hyper_parallel.models.llama import LlamaConfig, Transformer
from hyper_parallel.models.moe import MoEConfig, MoETransformer

RECIPES = ("tensorwise", "rowwise")  # training.float8_recipe's values
_HIGH_PRECISION_FQNS = ("output", "lm_head")  # the output layer: ours, transformers'
_HIGH_PRECISION_SUFFIXES = ("router.gate", "mlp.gate")  # a mixture of experts' routers: ours, transformers'


def _keep_high_precision(module: nn.Module, fqn: str) -> bool:
    """For an ``nn.Linear`` ``module`` at ``fqn``: the output layer, a router, a subclass (its own
    forward, which a float8 linear would drop: transformers' Llama 4 and PhiMoE routers are
    ``nn.Linear`` subclasses), or a size float8 matmuls cannot take."""
    if fqn in _HIGH_PRECISION_FQNS or fqn.endswith(_HIGH_PRECISION_SUFFIXES) or type(module) is not nn.Linear:
        return True
    return bool(module.in_features % 16 or module.out_features % 16)


def float8_layer_problems(shape: Union[LlamaConfig, MoEConfig]) -> List[str]:
    """:func:`float8_linear_problems` of the model of ``shape`` (a Llama or a mixture of experts)."""
    with torch.device("meta"):  # the blocks are alike (an MoE's first dense and first MoE block tell)
        if isinstance(shape, MoEConfig):
            model = MoETransformer(dataclasses.replace(shape, n_layers=min(shape.n_layers, shape.first_k_dense + 1)))
        else:
            model = Transformer(dataclasses.replace(shape, n_layers=1))
    return float8_linear_problems(model, f"with model.dim={shape.dim}, model.ffn_hidden_dim={shape.ffn_hidden_dim}")


def float8_linear_problems(model: nn.Module, sizes_from: str, name: str = "this model") -> List[str]:
    """The one-line problem when ``training.float8`` is on but no linear of ``model`` (e.g. on the
    meta device) would run in float8 (every plain linear but the output layer and the routers
    has a size that is not a multiple of 16): the job would train in high precision while saying
    float8. ``sizes_from`` says where the sizes come from and ``name`` the model, in the line."""
    linears = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    if any(not _keep_high_precision(m, fqn) for fqn, m in linears.items()):
        return []
    sizes = sorted({f"{m.in_features}->{m.out_features}" for fqn, m in linears.items() if type(m) is nn.Linear
                    and fqn not in _HIGH_PRECISION_FQNS and not fqn.endswith(_HIGH_PRECISION_SUFFIXES)})
    return [f"training.float8=true, but no linear layer of {name} can run in float8 (in and out sizes must be "
            f"multiples of 16; its blocks' linears are {', '.join(sizes)} {sizes_from}): set training.float8=false "
            "or change the model's sizes"]


def convert_to_float8(model: nn.Module, recipe: str, *, float8_all_gather: bool = True) -> None:
    """Swap ``model``'s eligible ``nn.Linear`` s for torchao's ``Float8Linear`` (in place, on
    any device including meta; before activation checkpointing, compile and ``fully_shard``).
    ``float8_all_gather=False``: tensorwise weights are gathered in high precision (what torch's
    fully_shard needs on backends without float8 collectives, e.g. gloo).

    Raises:
        MissingDependency: torchao is not installed.
        ValueError: ``recipe`` is not one of :data:`RECIPES`.
    """
    if recipe not in RECIPES:
        raise ValueError(f"training.float8_recipe={recipe!r}: expected one of {RECIPES}")
    float8 = require("torchao.float8", "training.float8=true")
    if recipe == "tensorwise":
        config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=float8_all_gather)
    else:
        config = float8.Float8LinearConfig.from_recipe_name(recipe)
    float8.convert_to_float8_training(model, config=config,
                                      module_filter_fn=lambda mod, fqn: not _keep_high_precision(mod, fqn))


def precompute_scales(model: nn.Module) -> None:
    """After the optimizer step: the float8 scales of all (sharded) tensorwise weights from one
    all-reduce of their amaxes, used by the next all-gathers (else each weight's
    ``fsdp_pre_all_gather`` all-reduces its own amax). A no-op without such weights."""
    try:
        float8 = require("torchao.float8", "training.float8=true")
    except MissingDependency:
        return
    float8.precompute_float8_dynamic_scale_for_fsdp(model)
