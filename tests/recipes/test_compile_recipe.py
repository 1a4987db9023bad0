"""``training.compile=true`` end to end: 2 ranks under torchrun on CPU with ``aot_eager``."""

from __future__ import annotations

import pytest

from hyper_parallel.trainer import compose_config
from hyper_parallel.trainer.config import ConfigError, validate_config
from tests.recipes.launch import TINY, assert_losses_match, last_loss_per_step, run, torchrun_cmd

STEPS = ["training.steps=3", "model.activation_checkpointing=true"]


def test_compiled_recipe_matches_eager(tmp_path):
    compiled_out, eager_out = tmp_path / "compiled", tmp_path / "eager"
    cmd = torchrun_cmd(2, [*TINY, *STEPS, f"output_dir={compiled_out}", "training.compile=true",
                           "training.compile_backend=aot_eager"], extra=["--standalone"])
    compiled = run(cmd, timeout=300, extra_env={"TORCH_LOGS": "dynamo"})
    assert compiled.returncode == 0, compiled.stderr[-4000:]
    logs = compiled.stdout + compiled.stderr
    # The block body (activation checkpointing inside) is compiled; fully_shard's hooks are not.
    assert "torchdynamo done tracing checkpointed_forward" in logs, logs[-4000:]
    assert "fully_shard" not in logs, logs[-4000:]
    eager = run(torchrun_cmd(2, [*TINY, *STEPS, f"output_dir={eager_out}"], extra=["--standalone"]), timeout=300)
    assert eager.returncode == 0, eager.stderr[-4000:]
    expected, actual = last_loss_per_step(str(eager_out)), last_loss_per_step(str(compiled_out))
    assert sorted(actual) == [1, 2, 3]
    assert_losses_match(expected, actual, rel=1e-5)


@pytest.mark.parametrize("overrides, message", [
    (["training.compile=yes"], "training.compile='yes' must be true or false"),
    (["training.compile=true", "training.compile_backend=nope"],
     "training.compile_backend='nope' is not a torch.compile backend"),
])
def test_bad_compile_keys_are_rejected(overrides, message):
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg, world_size=2)


def test_compile_defaults():
    t = compose_config([]).training
    assert t.compile is False and t.compile_backend == "inductor"
