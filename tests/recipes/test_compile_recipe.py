"""``training.compile=true`` end to end: 2 ranks under torchrun on CPU with ``aot_eager``; and,
in-process ranks in float64, with context parallelism and with a mixture of experts (blocks
with graph breaks)."""

from __future__ import annotations

from typing import Dict, List, Sequence

import pytest
import torch
import torch.distributed as dist

from hyper_parallel._torch_compat import dynamo_graphs_compiled
from hyper_parallel.platform import get_platform
from hyper_parallel.trainer import compose_config, run_training
from hyper_parallel.trainer.config import ConfigError, validate_config
from tests.multirank import run_on_ranks
from tests.recipes.launch import TINY, assert_losses_match, last_loss_per_step, read_metrics, run, torchrun_cmd

STEPS = ["training.steps=3", "model.activation_checkpointing=true"]


@pytest.mark.slow  # the recipe compiled, in-process: test_cp2_compiled_with_checkpointing_trains_like_one_process;
# hooks left eager: tests/fully_shard/test_compile.py
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


# Context parallelism with compile: the ring exchange stays eager (a graph break), the rest of
# each block compiles. float64 (see tests/recipes/test_cp_recipe.py): CP and compile only change
# the summation order, ~1e-16 relative; a lost block or gradient moves the loss by 1e-4 or more.
CP_REL = 1e-9
CP_STEPS = ["training.steps=3", "training.seq_len=16"]
CP_COMPILE = ["parallel.cp=2", "training.compile=true", "training.compile_backend=aot_eager"]


def _train_float64(overrides: List[str], base: Sequence[str] = (*TINY, *CP_STEPS)) -> int:
    """Train in float64 on this rank; returns how many graphs dynamo compiled for it."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch.compiler.reset()  # the rank processes are reused: no graph cached by an earlier test
    before = dynamo_graphs_compiled()
    try:
        cfg = compose_config([*base, *overrides])
        run_training(validate_config(cfg, dist.get_world_size()), get_platform())
    finally:
        torch.set_default_dtype(default)
    return dynamo_graphs_compiled() - before


def _loss_and_grad_norm(output_dir: str) -> Dict[str, Dict[int, float]]:
    records = [r for r in read_metrics(output_dir) if "grad_norm" in r]
    return {"loss": last_loss_per_step(output_dir), "grad_norm": {r["step"]: r["grad_norm"] for r in records}}


def _assert_same_curves(expected: Dict[str, Dict[int, float]], actual: Dict[str, Dict[int, float]]) -> None:
    for curve in ("loss", "grad_norm"):
        assert sorted(expected[curve]) == sorted(actual[curve]) == [1, 2, 3], (expected, actual)
        for step, value in expected[curve].items():
            assert actual[curve][step] == pytest.approx(value, rel=CP_REL, abs=0), (curve, step)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Dict[str, Dict[int, float]]:
    """The losses and gradient norms of one eager process (no CP) on the same batches."""
    out = tmp_path_factory.mktemp("cp1")
    assert run_on_ranks(1, _train_float64, [f"output_dir={out}"], timeout=300) == [0]
    return _loss_and_grad_norm(str(out))


def test_cp2_compiled_with_checkpointing_trains_like_one_process(tmp_path, one_process):
    """CP2 with compiled blocks and activation checkpointing around them has the losses and
    gradient norms of one eager process, and dynamo compiled each block's code around the ring
    attention (not silently left it eager). (Compile without checkpointing under CP:
    tests/test_context_parallel.py, the whole model compiled.)"""
    ac = ["model.activation_checkpointing=true"]
    graphs = run_on_ranks(2, _train_float64, [f"output_dir={tmp_path / 'cp2'}", *CP_COMPILE, *ac], timeout=300)
    # Per block: the norm before attention, the projections and RoPE, the output projection
    # and the feed-forward after it (the two blocks share the code).
    assert all(n >= 4 for n in graphs), graphs
    _assert_same_curves(one_process, _loss_and_grad_norm(str(tmp_path / "cp2")))


# A mixture of experts splits its tokens by expert with data-dependent sizes (a graph break):
# its blocks compile like CP's, around the break (tests/recipes/test_moe_cp_recipe.py).
MOE = ["model=moe_debug", "training.seq_len=16", "training.global_batch_size=4", "training.steps=3",
       "optim.lr=1e-2", "optim.warmup_steps=1", "logging.log_every=1", "checkpoint.interval=100"]
