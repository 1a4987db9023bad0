"""Context parallelism (``parallel.cp``) in the recipe: a CP run trains, evaluates and
checkpoints exactly like a run without CP on the same global batches.

The runs are in float64 (the default dtype set on each rank before the model is built; see
tests/fully_shard/_helpers.py, [Note: parity in float64]): CP sums the attention and the loss
in another order than one process, which is ~1e-16 relative noise that a few AdamW steps keep
far below the tolerance; a defect (a lost block, a wrong position, a wrong gradient average or
data order) moves the loss by 1e-4 or more.
"""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.platform import get_platform
from hyper_parallel.trainer import ConfigError, compose_config, run_training, validate_config
from hyper_parallel.trainer.reporting import layout
from tests.multirank import run_on_ranks
from tests.recipes.launch import TINY, last_loss_per_step, read_metrics
from tests.recipes.train_in_process import one_line_error

REL = 1e-9
CP2 = ["parallel.cp=2"]
STEPS = ["training.steps=4", "training.seq_len=16", "eval.every=2", "eval.steps=1", "checkpoint.interval=2"]


def _train_float64(overrides: List[str]) -> None:
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        cfg = compose_config([*TINY, *STEPS, *overrides])
        run_training(validate_config(cfg, dist.get_world_size()), get_platform())
    finally:
        torch.set_default_dtype(default)


def _curves(output_dir: str) -> Dict[str, Dict[int, float]]:
    records = read_metrics(output_dir)
    return {"loss": last_loss_per_step(output_dir),
            "val_loss": {r["step"]: r["val_loss"] for r in records if "val_loss" in r}}


def _assert_close(expected: Dict[int, float], actual: Dict[int, float]) -> None:
    assert sorted(actual) == sorted(expected) and expected, (expected, actual)
    for step, value in expected.items():
        assert abs(actual[step] - value) <= REL * abs(value), (step, value, actual[step])


# name: (world size, overrides)
RUNS = {"cp1": (1, []), "dp2": (2, []), "cp2": (2, CP2),
        "hsdp2_cp2_allgather_ac_accum": (4, [*CP2, "parallel.dp_replicate=2", "parallel.cp_rotate=allgather",
                                             "model.activation_checkpointing=true", "training.grad_accum_steps=2"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The output folders of the :data:`RUNS`, each trained for 4 steps (checkpoints at 2 and 4)."""
    root = tmp_path_factory.mktemp("cp_runs")
    for name, (world, overrides) in RUNS.items():
        run_on_ranks(world, _train_float64, [f"output_dir={root / name}", *overrides], timeout=180)
    return root


def test_cp2_trains_and_evaluates_like_cp1_and_dp2(runs):
    """The same losses and validation losses at every step, whatever the CP degree and rotation,
    also with HSDP over two data-parallel ranks x CP2, activation checkpointing and gradient
    accumulation."""
    curves = {name: _curves(str(runs / name)) for name in RUNS}
    expected = curves["cp1"]
    assert len(expected["loss"]) == 4 and sorted(expected["val_loss"]) == [2, 4], expected
    for name in RUNS:
        _assert_close(expected["loss"], curves[name]["loss"])
        _assert_close(expected["val_loss"], curves[name]["val_loss"])
    assert '"mesh": {"shard": 1, "cp": 2}' in (runs / "cp2" / "metrics.jsonl").read_text()


def test_startup_line_names_the_mesh_with_cp():
    config = validate_config(compose_config([*TINY, *CP2, "parallel.dp_shard=2"]), 4)
    assert layout(config.cfg, config.dims) == "mesh 2x2 (shard, cp), context parallel over 2 ranks (ring), fp32"
    assert config.dims.mesh_shape == {"shard": 2, "cp": 2} and config.dims.loss_ranks == 4
    # The CP ranks of one data-parallel index read the same samples.
    assert [config.dims.dp_rank(rank) for rank in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize("world, overrides, expected", [
    (2, ["training.seq_len=18"], "training.seq_len=18 is not divisible by 2 x parallel.cp=2 = 4 (each sequence"),
    (4, ["parallel.tp=2"], "parallel.cp=2 with parallel.tp=2 is not supported yet; use context parallelism with "
                           "data parallelism only"),
    (4, ["parallel.pp=2"], "parallel.cp=2 with parallel.pp=2 is not supported yet"),
    (2, ["parallel.cp=3", "training.seq_len=60"], "parallel.cp=3 does not divide the world size 2"),
    (2, ["parallel.cp_rotate=zigzag"], "parallel.cp_rotate"),
])
def test_impossible_cp_settings_are_refused_in_one_line(check, monkeypatch, world, overrides, expected):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    one_line_error(*check(*CP2, *overrides)[::2], expected)


def test_a_model_without_the_projects_attention_is_refused():
    from hyper_parallel.models.llama import Transformer
    from hyper_parallel.trainer.config import llama_config
    from hyper_parallel.trainer.context import check_attention

    with torch.device("meta"):
        model = Transformer(llama_config(compose_config(TINY).model))
    check_attention(model)
    model.layers["1"].attention = torch.nn.MultiheadAttention(32, 4)
    with pytest.raises(ConfigError, match=r"parallel.cp needs the project's attention .* block 1 "
                                          r"\(TransformerBlock\) has none"):
        check_attention(model)


@pytest.mark.parametrize("world", [1, 2], ids=["cp1", "dp2"])
def test_a_cp2_checkpoint_resumes_without_cp_on_the_uninterrupted_curve(runs, tmp_path, world):
    """CP2's step-2 checkpoint, resumed on one rank or on two data-parallel ranks, continues
    the uninterrupted losses (data order, optimizer state and schedule included)."""
    run_on_ranks(world, _train_float64, [f"output_dir={tmp_path}", f"checkpoint.load_from={runs}/cp2/checkpoints/step-2"],
                 timeout=180)
    resumed, expected = _curves(str(tmp_path)), _curves(str(runs / "cp1"))
    _assert_close({step: expected["loss"][step] for step in (3, 4)}, resumed["loss"])
    _assert_close({4: expected["val_loss"][4]}, resumed["val_loss"])
