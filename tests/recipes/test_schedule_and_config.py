"""LR schedule values and state, and start-up config validation (in-process)."""

import dataclasses
import math
import os

import pytest
import torch

from hyper_parallel.trainer import ConfigError, WarmupCosineSchedule, compose_config, validate_config, warmup_cosine_lr


def test_warmup_then_cosine_to_the_floor():
    lr = lambda s: warmup_cosine_lr(s, peak_lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [lr(s) for s in range(1, 5)] == [0.25, 0.5, 0.75, 1.0]
    assert lr(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr(14) == pytest.approx(0.1) and lr(20) == pytest.approx(0.1)
    assert all(lr(s) > lr(s + 1) for s in range(4, 14))


def test_schedule_state_round_trip_sets_the_optimizer_lr():
    params = [torch.nn.Parameter(torch.zeros(1))]
    make = lambda: WarmupCosineSchedule(torch.optim.SGD(params, lr=0.0), peak_lr=2.0, warmup_steps=2,
                                        total_steps=10, min_lr_ratio=0.0)
    a = make()
    lrs = [a.step() for _ in range(6)]
    b = make()
    b.load_state_dict(a.state_dict())
    assert b.step() == a.step() == warmup_cosine_lr(7, peak_lr=2.0, warmup_steps=2, total_steps=10, min_lr_ratio=0.0)
    assert b.optimizer.param_groups[0]["lr"] == b.lr and lrs[1] == 2.0


def test_defaults_validate_and_resolve_the_mesh():
    cfg = compose_config([])
    assert cfg.checkpoint.folder == f"{cfg.output_dir}/checkpoints"
    assert validate_config(cfg, 2).dims.shard == 2
    dims = validate_config(compose_config(["parallel=hsdp"]), 4).dims
    assert (dims.replicate, dims.shard) == (2, 2)


@pytest.mark.parametrize("overrides,world,message", [
    (["parallel.dp_replicate=2", "parallel.dp_shard=3"], 4, "does not factor the world size 4"),
    (["parallel=hsdp"], 3, "dp_replicate=2 does not divide the world size 3"),
    (["training.global_batch_size=8", "training.grad_accum_steps=3"], 2, "needs a multiple of 6"),
    (["training.steps=-5"], 1, "training.steps=-5 must be a positive integer"),
    (["parallel.mixed_precision=fp8"], 1, "must be one of"),
    (["training.seq_len=512"], 1, "exceeds model.max_seq_len=256"),
    (["data=tokens"], 1, "required value(s) not set: data.path"),
    (["model.n_heads=5"], 1, "model: dim=64 is not divisible by n_heads=5"),
    # Where the validation data comes from is a relation of keys: the config check refuses it.
    (["data=text", "data.paths=c.txt", "data.val_fraction=0.1", "data.val_path=v.txt"], 1,
     "data.val_fraction=0.1 and data.val_path=v.txt: set one of them, not both"),
    (["data=tokens", "data.path=t.bin", "eval.every=5"], 1,
     "eval.every=5 needs validation data: set data.val_fraction or data.val_path"),
    (["eval.every=10", "eval.steps=300"], 1, "eval.steps=300 is more than training.steps=200"),
])
def test_bad_values_are_named(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(overrides), world)
    assert message in str(err.value)


@pytest.mark.parametrize("overrides,message", [
    (["training.stepz=3"], "unknown key training.stepz (did you mean training.steps"),
    (["model=llama_99b"], "Could not find 'model/llama_99b'"),
    (["training.steps"], "Error parsing override"),
])
def test_unknown_keys_and_options_are_named(overrides, message):
    with pytest.raises(ConfigError, match=None) as err:
        compose_config(overrides)
    assert message in str(err.value)


def test_every_problem_is_listed_in_one_message():
    cfg = compose_config(["training.max_grad_norm=abc", "optim.lr=0", "optim.min_lr_ratio=2",
                          "logging.log_every=0", "parallel.dp_shard=3"])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, 2)
    message = str(err.value)
    for expected in ("training.max_grad_norm='abc' must be a finite number >= 0", "optim.lr=0 must be a finite number > 0",
                     "optim.min_lr_ratio=2 must be a finite number in [0, 1]", "logging.log_every=0 must be a positive",
                     "parallel.dp_shard=3 does not factor the world size 2"):
        assert expected in message


def test_the_typed_config_holds_the_composed_values_in_the_data_kinds_class():
    from omegaconf import OmegaConf

    from hyper_parallel.trainer import TrainConfig, typed_config
    from hyper_parallel.trainer.config.data import DATA_KINDS

    for kind, extra in (("synthetic", []), ("text", ["data.paths=[a,b]"]), ("tokens", ["data.path=x"])):
        cfg = compose_config([f"data={kind}", *extra, "training.steps=7", "optim.betas=[0.8,0.9]"])
        typed = typed_config(cfg)
        assert isinstance(typed, TrainConfig) and type(typed.data) is DATA_KINDS[kind]
        assert typed.training.steps == 7 and typed.optim.betas == [0.8, 0.9]
        assert dataclasses.asdict(typed) == OmegaConf.to_container(cfg, resolve=True)


def test_presets_hold_only_what_differs_from_the_schema():
    """Defaults live in the config schema alone: a preset restating one would drift from it."""
    from omegaconf import OmegaConf

    from hyper_parallel.trainer.config.compose import CONFIG_DIR
    from hyper_parallel.trainer.config.rules import defaults
    from hyper_parallel.trainer.config.data import DATA_KINDS
    from hyper_parallel.trainer.config.schema import GROUPS, TrainConfig

    schemas = {**GROUPS, **{f"data/{kind}": cls for kind, cls in DATA_KINDS.items()}}
    for group, cls in schemas.items():
        folder = os.path.join(CONFIG_DIR, group.split("/")[0])
        names = [group.split("/")[1] + ".yaml"] if "/" in group else sorted(os.listdir(folder))
        for name in names:
            preset = OmegaConf.to_container(OmegaConf.load(os.path.join(folder, name)))
            preset.pop("defaults")
            restated = {k: v for k, v in preset.items() if defaults(cls)[k] == v}
            assert not restated, f"configs/{group}/{name} restates schema defaults {restated}"
    train = OmegaConf.to_container(OmegaConf.load(os.path.join(CONFIG_DIR, "train.yaml")))
    assert set(train) == {"defaults"} and TrainConfig().training.steps == compose_config([]).training.steps
