"""The real-size MoE presets (``configs/model/<name>.yaml``) are the model sizes of
``hyper_parallel.models.moe.MOE_CONFIGS`` of the same name, key for key, and validate for the
layouts docs/moe.md recommends (the shapes only: nothing is allocated)."""

from __future__ import annotations

import pytest

from hyper_parallel.models.moe import MOE_CONFIGS, MoEConfig, param_counts
from hyper_parallel.trainer import compose_config, validate_config
from hyper_parallel.trainer.config.model import model_config
from hyper_parallel.trainer.launch.preflight import estimate_memory


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_each_moe_preset_is_the_named_model_size(name):
    composed = model_config(validate_config(compose_config([f"model={name}"]), 1).cfg.model)
    assert composed == MoEConfig(**MOE_CONFIGS[name])


@pytest.mark.parametrize("name, world, overrides", [
    ("qwen3_30b_a3b", 8, ["parallel.ep=8", "parallel.mixed_precision=bf16"]),
    ("deepseek_v3_16b", 16, ["parallel.dp_replicate=2", "parallel.ep=8", "parallel.mixed_precision=bf16"]),
])
def test_recommended_layouts_validate(name, world, overrides):
    valid = validate_config(compose_config([f"model={name}", "training.seq_len=4096", *overrides]), world)
    assert valid.cfg.parallel.ep == 8 and valid.dims.world_size == world
    # the pre-start check's count is the model's (dense first blocks counted as dense): 15.67B, 30.53B
    assert estimate_memory(valid.cfg, valid.dims).parameters == param_counts(MoEConfig(**MOE_CONFIGS[name])).total
