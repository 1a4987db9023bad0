"""``training.float8``: torchao float8 linears (optional ``hyper_parallel[float8]`` extra).

``tensorwise`` (dynamic, one scale per tensor) gathers the weights in float8 through
fully_shard's all-gather extension and computes all weights' scales with one all-reduce after
the optimizer step; ``rowwise`` (one scale per row, more accurate, slower) gathers in the
compute dtype. The output layer and linears whose dims float8 matmuls cannot take (not
multiples of 16) stay in high precision, as torchtitan filters them (docs/recipes.md).
"""

from __future__ import annotations

from typing import List

from torch import nn

from hyper_parallel._optional import MissingDependency, available, install_hint, require
from hyper_parallel.trainer.config_schema import TrainConfig

RECIPES = ("tensorwise", "rowwise")
_HIGH_PRECISION_FQNS = ("output",)


def float8_problems(cfg: TrainConfig) -> List[str]:
    """The one-line problem when ``training.float8`` is on without torchao."""
    if cfg.training.float8 and not available("torchao"):
        return [f"{install_hint('torchao', 'training.float8=true')}, or set training.float8=false"]
    return []


def _keep_high_precision(module: nn.Module, fqn: str) -> bool:
    if fqn in _HIGH_PRECISION_FQNS:
        return True
    return isinstance(module, nn.Linear) and (module.in_features % 16 or module.out_features % 16)


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
