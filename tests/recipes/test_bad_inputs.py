"""Bad recipe inputs, through ``recipes/train.py --check`` in-process: one line, exit 2.

The cases come from outside checks: inputs that gave a traceback wall or ran on
nonsense with exit 0. ``--check`` runs what every rank runs before the process group starts.
"""

from __future__ import annotations

import os
import time

import pytest

from hyper_parallel.checkpoint import save
from hyper_parallel.trainer import compose_config, validate_config
from hyper_parallel.trainer.launch import preflight
from hyper_parallel.trainer.config.data import DATA_KEYS as DATA_SCHEMA
from tests.recipes.train_in_process import one_line_error, recipe

GIB = 1024**3


@pytest.mark.parametrize("override,expected", [
    # a traceback wall before
    ("optim.betas=[2,3]", "optim.betas=[2, 3] must be a list of 2 values, each a finite number in [0, 1)"),
    ("optim.betas=abc", "optim.betas='abc' must be a list of 2 values"),
    ("optim.eps=-1", "optim.eps=-1 must be a finite number > 0"),
    ("parallel.dp_replicate=abc", "parallel.dp_replicate='abc' must be a positive integer"),
    ("parallel.dp_replicate=null", "parallel.dp_replicate=None must be a positive integer"),
    ("model.dim=0", "model.dim=0 must be a positive integer"),
    ("model.dim=-64", "model.dim=-64 must be a positive integer"),
    ("model.n_heads=0", "model.n_heads=0 must be a positive integer"),
    ("model.n_layers=0", "model.n_layers=0 must be a positive integer"),
    ("model.n_layers=-1", "model.n_layers=-1 must be a positive integer"),
    ("model.ffn_hidden_dim=0", "model.ffn_hidden_dim=0 must be null or a positive integer"),
    ("training.seed=1e29", "training.seed=1e+29 must be an integer in [0, 4294967295]"),
    ("model.n_heads=64", "model: dim/n_heads = 1 must be even (RoPE rotates pairs)"),
    ("model.dim=6", "model: dim=6 is not divisible by n_heads=4"),
    # exit 0 on nonsense before
    ("checkpoint.async_save=maybe", "checkpoint.async_save='maybe' must be true or false"),
    ("checkpoint.resume=abc", "checkpoint.resume='abc' must be true or false"),
    ("+training.foo=1", "unknown key training.foo"),
    ("model.rope_theta=-1", "model.rope_theta=-1 must be a finite number > 0"),
    ("data.concentration=0", "data.concentration=0 must be a finite number > 0"),
    ("optim.lr=inf", "optim.lr=inf must be a finite number > 0"),
    ("training.stepz=5", "unknown key training.stepz (did you mean training.steps"),
    ("+data.path=x", "data.path is not a key of data=synthetic (it belongs to data=tokens)"),
])
def test_bad_value_gives_one_line_and_exit_2(check, override, expected):
    code, _, err = check(override)
    one_line_error(code, err, expected)


def test_a_good_config_passes(check):
    code, out, err = check()
    assert code == 0 and out.strip() == "config OK for 2 rank(s)" and not err


def test_several_problems_are_listed_together(check):
    code, _, err = check("optim.eps=-1", "model.dim=0", "+training.foo=1")
    assert code == 2 and err.startswith("error: invalid configuration:\n"), err
    for expected in ("optim.eps=-1", "model.dim=0", "unknown key training.foo"):
        assert expected in err


@pytest.mark.parametrize("override,needs", [
    ("model.vocab_size=1000000000", "parameters"),       # ran for 9 minutes before
    ("training.global_batch_size=4000000", "logits"),    # a traceback wall before
])
def test_absurd_sizes_fail_fast_with_a_memory_estimate(check, monkeypatch, override, needs):
    monkeypatch.setattr(preflight, "available_memory", lambda: (16 * GIB, None))
    started = time.monotonic()
    code, _, err = check(override)
    assert time.monotonic() - started < 10
    one_line_error(code, err, "of host memory for 2 rank(s) on this machine")
    assert needs in err and "16GiB is available" in err


def test_the_memory_estimate_is_a_lower_bound_that_admits_the_default_job():
    cfg = compose_config(["model.vocab_size=1000", "training.global_batch_size=8", "training.seq_len=16"])
    est = preflight.estimate_memory(cfg, validate_config(cfg, 2).dims)
    llama = 1000 * 64 * 2 + 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 192 + 2 * 64) + 64
    assert est.parameters == llama
    assert est.model_state == 16 * llama // 2
    assert est.logits == 2 * 4 * (8 // 2) * 16 * 1000
    host, device = preflight.available_memory()
    assert host > 0 and device is None  # this CPU machine
    assert not preflight.memory_problems(compose_config([]), validate_config(compose_config([]), 2).dims, 2)


def test_output_folder_under_a_file(check, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    code, _, err = check(f"output_dir={blocker}/run")
    assert code == 2 and f"{blocker} is a file, not a folder" in err, err
    assert "output_dir=" in err and "checkpoint.folder=" in err  # both derive from output_dir
    code, _, err = check(f"checkpoint.folder={blocker}/ckpt")
    one_line_error(code, err, f"checkpoint.folder={blocker}/ckpt cannot be used: {blocker} is a file")


def test_a_checkpoint_folder_url_of_an_unknown_scheme_is_refused_before_anything_is_created(check, tmp_path,
                                                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = check(f"output_dir={tmp_path}/run", "checkpoint.folder=nosuchfs://bucket/run")
    one_line_error(code, err, "checkpoint.folder: checkpoint 'nosuchfs://bucket/run': nosuchfs:// is no storage")
    assert not (tmp_path / "nosuchfs:").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_folder(check, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code, _, err = check(f"output_dir={locked}/run", f"checkpoint.folder={tmp_path}/ckpt")
        one_line_error(code, err, f"output_dir={locked}/run cannot be used: Permission denied")
    finally:
        locked.chmod(0o700)


def test_init_from_must_be_a_folder(check, tmp_path):
    code, _, err = check(f"model.init_from={tmp_path}/nope")
    one_line_error(code, err, f"model.init_from={tmp_path}/nope is not a folder")


def test_resume_false_refuses_a_folder_holding_checkpoints(check, tmp_path):
    folder = tmp_path / "out" / "checkpoints"
    save({"x": 1}, checkpoint_id=str(folder / "step-3"), no_dist=True)
    code, _, err = check("checkpoint.resume=false")
    one_line_error(code, err, f"checkpoint.resume=false, but checkpoint.folder={folder} holds checkpoints")
    assert "step-3" in err and "Use a new output_dir" in err
    assert check()[0] == 0  # resuming is fine
    code, _, err = check("checkpoint.resume=false", f"checkpoint.folder={tmp_path}/fresh")
    assert code == 0, err


def test_every_schema_key_is_in_the_config_files_and_every_data_kind_composes():
    for kind, keys in DATA_SCHEMA.items():
        overrides = [f"data={kind}"] + {"text": ["data.paths=x"], "tokens": ["data.path=x"]}.get(kind, [])
        cfg = compose_config(overrides)
        validate_config(cfg, 1)
        assert set(cfg.data) == {"kind", *keys}
    for model in ("llama_debug", "llama_50m", "llama_1b", "llama_8b", "llama_70b"):
        validate_config(compose_config([f"model={model}", "training.seq_len=64"]), 8)


def test_an_output_dir_url_is_refused_before_anything_is_created(check, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = check("output_dir=s3://bucket/run", f"checkpoint.folder={tmp_path}/ckpt")
    one_line_error(code, err, "output_dir: 's3://bucket/run' is a URL; output_dir must be a local or mounted folder")
    assert not (tmp_path / "s3:").exists()


@pytest.mark.parametrize("overrides,expected", [
    (["training.float8_recipe=rowwise"],
     "training.float8_recipe=rowwise needs training.float8=true (it has no effect without it)"),
    (["training.float8_recipe=tensorwise"], "training.float8_recipe=tensorwise needs training.float8=true"),
    (["parallel.pp_schedule=1F1B"], "parallel.pp_schedule=1F1B needs parallel.pp > 1 (it has no effect"),
    (["training.float8=true", "model.dim=24", "model.n_heads=2", "model.n_kv_heads=2"],
     "training.float8=true, but no linear layer of this model can run in float8 (in and out sizes must be multiples "
     "of 16; its blocks' linears are 24->24, 24->64, 64->24 with model.dim=24, model.ffn_hidden_dim=64)"),
])
def test_a_setting_that_would_have_no_effect_is_refused(check, overrides, expected):
    one_line_error(*check(*overrides)[::2], expected)


def test_float8_on_a_model_with_float8_layers_passes(check):
    pytest.importorskip("torchao.float8", reason="torchao is not installed")
    code, _, err = check("training.float8=true", "training.float8_recipe=rowwise")
    assert code == 0, err


@pytest.mark.parametrize("overrides,expected", [
    # every rank crashed after step 1 before
    (["model.moe.first_k_dense=2", "model.ffn_hidden_dim=64"],
     "model.moe.first_k_dense=2 leaves no MoE block of the model.n_layers=2: it must be less than n_layers"),
    # trained on before: one update overrode every choice of the router
    (["model.moe.expert_bias_update_rate=1e30"], "model.moe.expert_bias_update_rate=1e+30 must be a finite number "
                                                 "in [0, 0.5)"),
    (["model.moe.expert_bias_update_rate=0.5"], "model.moe.expert_bias_update_rate=0.5 must be a finite number"),
    # diverged at step 1 with a message blaming optim.lr before
    (["model.moe.aux_loss_weight=1e300"], "model.moe.aux_loss_weight=1e+300 must be a finite number in [0, 1]"),
])
def test_absurd_moe_settings_are_refused(check, overrides, expected):
    one_line_error(*check("model=moe_debug", *overrides)[::2], expected)


def test_check_takes_the_world_size_as_an_option(tmp_path, monkeypatch, capsys):
    """A multi-rank layout is checked without setting WORLD_SIZE by hand."""
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    out = f"output_dir={tmp_path / 'out'}"
    layout = ["parallel.dp_replicate=2", "parallel.dp_shard=2"]
    assert recipe.main(["--check", out, *layout]) == 2  # 1 rank from the environment: the layout needs 4
    assert "world" in capsys.readouterr().err
    assert recipe.main(["--check", "--world-size", "4", "--ranks-per-node=2", out, *layout]) == 0
    assert capsys.readouterr().out.strip() == "config OK for 4 rank(s)"
    code = recipe.main(["--check", "--world-size=8", out, *layout])
    one_line_error(code, capsys.readouterr().err, "8")
    code = recipe.main(["--check", "--world-size", "0", out])
    one_line_error(code, capsys.readouterr().err, "--world-size takes a positive number of ranks, not '0'")
    code = recipe.main(["--world-size", "4", out])
    one_line_error(code, capsys.readouterr().err, "only go with --check")
