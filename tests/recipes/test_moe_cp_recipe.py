"""The recipe with a mixture of experts under context parallelism (``model=moe_debug
parallel.cp=2``, with and without ``parallel.ep=2``), in float64 in-process on the shared gloo
rank pools: the CP ranks of a data-parallel rank balance its tokens together, so the losses, aux
loss, expert load and evaluation are those of one process on the same batches; a CP checkpoint
resumes without CP on the uninterrupted curve; with pipeline parallelism and with compiled,
checkpointed blocks; the config checks."""

from __future__ import annotations

import re
from typing import List

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.platform import get_platform
from hyper_parallel.trainer import compose_config, run_training, validate_config
from hyper_parallel.trainer.config.compose import ConfigError
from hyper_parallel.trainer.config.parallel import ParallelDims
from hyper_parallel.trainer.launch.reporting import layout
from tests.multirank import run_on_ranks
from tests.recipes.launch import last_loss_per_step, read_metrics
from tests.recipes import test_compile_recipe as compiled_recipe
from tests.recipes import test_moe_pipeline_recipe as pipeline_recipe
from tests.recipes.test_moe_pipeline_recipe import _assert_records_match
from tests.recipes.test_moe_recipe import MOE

EVAL = ["eval.every=2", "eval.steps=1"]


def _train(overrides: List[str]) -> None:
    torch.set_default_dtype(torch.float64)
    try:
        cfg = compose_config([*MOE, *EVAL, *overrides])
        run_training(validate_config(cfg, dist.get_world_size()), get_platform())
    finally:
        torch.set_default_dtype(torch.float32)


def test_cp2_trains_the_one_process_curve_and_resumes_without_cp(tmp_path):
    ref, cp2, one = (str(tmp_path / name) for name in ("ref", "cp2", "one"))
    run_on_ranks(1, _train, [f"output_dir={ref}"], timeout=180)
    # Each CP rank routes half of every sequence; the two halves balance together as one forward.
    run_on_ranks(2, _train, [f"output_dir={cp2}", "parallel.cp=2", "checkpoint.interval=2"], timeout=240)
    assert sorted(last_loss_per_step(cp2)) == [1, 2, 3, 4]
    _assert_records_match(ref, cp2, range(1, 5))
    assert read_metrics(ref)[0]["aux_loss"] > 0 and "val_loss" in read_metrics(ref)[1]
    # Its step-2 checkpoint resumed by one process continues the uninterrupted curve.
    run_on_ranks(1, _train, [f"output_dir={one}", f"checkpoint.load_from={cp2}/checkpoints/step-2"], timeout=180)
    assert sorted(last_loss_per_step(one)) == [3, 4]
    _assert_records_match(ref, one, range(3, 5))


def test_cp2_ep2_on_four_ranks_trains_the_one_process_curve(tmp_path):
    # dp_shard=2 x cp=2: the experts over ep=2 of the 4 dp_shard x cp ranks (efsdp 2). The 4
    # ranks balance the global batch together: one process on the same batch trains the same.
    # With DeepSeek's expert bias as well (its counts summed over every rank).
    ref, cpep = str(tmp_path / "ref"), str(tmp_path / "cpep")
    bias = ["model.moe.expert_bias_update_rate=0.001"]
    run_on_ranks(1, _train, [f"output_dir={ref}", *bias], timeout=180)
    run_on_ranks(4, _train, [f"output_dir={cpep}", "parallel.cp=2", "parallel.ep=2", *bias], timeout=300)
    assert sorted(last_loss_per_step(cpep)) == [1, 2, 3, 4]
    _assert_records_match(ref, cpep, range(1, 5))


def test_ep_with_cp_divides_dp_shard_x_cp():
    cfg = validate_config(compose_config([*MOE, "parallel.cp=2", "parallel.ep=4"]), 4).cfg
    assert layout(cfg, ParallelDims(1, 2, cp=2)) == \
        "mesh 2x2 (shard, cp), context parallel over 2 ranks (ring), experts over ep 4 x efsdp 1, fp32"
    message = "parallel.ep=8 does not divide the 2 x 2 dp_shard x cp ranks (expert parallelism splits"
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(compose_config([*MOE, "parallel.cp=2", "parallel.ep=8"]), 4)


def test_pp2_cp2_ep2_on_four_ranks_trains_the_one_process_curve(tmp_path):
    # 2 stages of 2 CP ranks (dp_shard=1): each stage's experts over ep=2 taken from its 2 CP
    # ranks; the CP ranks of a stage balance each pipeline micro-batch's tokens together, so
    # one process running the 2 micro-batches trains the same.
    ref, ppcp = str(tmp_path / "ref"), str(tmp_path / "ppcp")
    run_on_ranks(1, pipeline_recipe._train, [f"output_dir={ref}", "training.grad_accum_steps=2"], timeout=180)
    run_on_ranks(4, pipeline_recipe._train, [f"output_dir={ppcp}", "parallel.pp=2", "parallel.cp=2", "parallel.ep=2",
                                "parallel.pp_microbatches=2"], timeout=300)
    assert sorted(last_loss_per_step(ppcp)) == [1, 2, 3, 4]
    _assert_records_match(ref, ppcp, range(1, 5))


@pytest.mark.slow  # CP compiled with checkpointing: test_compile_recipe.py; CP2 x EP2: above; MoE blocks compiled
# around their breaks: tests/fully_shard/test_mixed_meshes.py
def test_cp2_ep2_compiled_with_checkpointing_trains_the_one_process_curve(tmp_path):
    # The counts' all-reduce over the CP group and the experts' split by token counts are graph
    # breaks, rerun with the recomputed forward; the experts over ep=2 of the 2 CP ranks.
    compiled, eager = tmp_path / "compiled", tmp_path / "eager"
    graphs = run_on_ranks(2, compiled_recipe._train_float64,
                          [f"output_dir={compiled}", "parallel.cp=2", "parallel.ep=2",
                           "model.activation_checkpointing=true", "training.compile=true",
                           "training.compile_backend=aot_eager"],
                          compiled_recipe.MOE, timeout=300)
    assert all(n >= 4 for n in graphs), graphs  # the blocks compiled around the breaks
    assert run_on_ranks(1, compiled_recipe._train_float64, [f"output_dir={eager}"], compiled_recipe.MOE,
                        timeout=300) == [0]
    compiled_recipe._assert_same_curves(compiled_recipe._loss_and_grad_norm(str(eager)),
                                        compiled_recipe._loss_and_grad_norm(str(compiled)))
