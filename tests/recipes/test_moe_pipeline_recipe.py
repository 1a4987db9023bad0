"""The recipe with a mixture of experts under pipeline parallelism (``model=moe_debug
parallel.pp=2``, with and without ``parallel.ep=2``), in float64 in-process on the shared gloo
rank pools: the losses, aux loss, expert load and evaluation of one process on the same
micro-batches, an EP4 checkpoint resumed on PP2 x EP2, and the config checks."""

from __future__ import annotations

import re
from typing import List

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.platform import get_platform
from hyper_parallel.trainer import compose_config, run_training, validate_config
from hyper_parallel.trainer.config.compose import ConfigError
from tests.multirank import run_on_ranks
from tests.recipes.launch import assert_losses_match, last_loss_per_step, read_metrics
from tests.recipes.test_moe_recipe import MOE

# 3 blocks: block 0 dense (first_k_dense), blocks 1-2 MoE; 2 stages: blocks 0-1 and block 2.
MOE_PP = [*MOE, "model.n_layers=3", "model.moe.first_k_dense=1", "model.ffn_hidden_dim=64", "eval.every=2",
          "eval.steps=1"]
REL = 1e-9  # float64: only the order of the sums differs between layouts


def _train(overrides: List[str]) -> None:
    torch.set_default_dtype(torch.float64)
    try:
        cfg = compose_config([*MOE_PP, *overrides])
        run_training(validate_config(cfg, dist.get_world_size()), get_platform())
    finally:
        torch.set_default_dtype(torch.float32)


def _assert_records_match(ref: str, run: str, steps: range) -> None:
    expected = {r["step"]: r for r in read_metrics(ref)}
    actual = {r["step"]: r for r in read_metrics(run)}
    for step in steps:
        a, b = expected[step], actual[step]
        for key in ("loss", "aux_loss", "expert_load", "grad_norm") + (("val_loss",) if "val_loss" in a else ()):
            rel = 1e-6 if key == "aux_loss" else REL  # (the MoE statistics are summed over the ranks in float32)
            assert abs(a[key] - b[key]) <= rel * abs(a[key]), (step, key, a[key], b[key])
        assert len(b["expert_load_per_block"]) == 2, b  # the MoE blocks of both stages
        assert all(abs(x - y) <= REL * x for x, y in zip(a["expert_load_per_block"], b["expert_load_per_block"]))


def test_an_ep4_checkpoint_resumes_on_pp2_x_ep2_on_the_one_process_curve(tmp_path):
    ref, ep4, ppep = (str(tmp_path / name) for name in ("ref", "ep4", "ppep"))
    # One process: 2 micro-batches per step, the 2 global micro-batches of the EP4 run (2
    # accumulation steps) and of the PP run (2 pipeline micro-batches), each balanced over all
    # data-parallel ranks.
    run_on_ranks(1, _train, [f"output_dir={ref}", "training.grad_accum_steps=2"], timeout=180)
    # ep=4 over the 4 dp_shard ranks (2 experts each), stopped after step 2.
    run_on_ranks(4, _train, [f"output_dir={ep4}", "parallel.ep=4", "training.grad_accum_steps=2",
                             "training.stop_after_steps=2"], timeout=240)
    assert sorted(last_loss_per_step(ep4)) == [1, 2]
    _assert_records_match(ref, ep4, range(1, 3))
    assert read_metrics(ep4)[0]["aux_loss"] > 0
    # Its checkpoint resumed by pp=2 x dp_shard=2 on 4 ranks, the experts of each stage over ep=2
    # of its 2 ranks, to the end.
    run_on_ranks(4, _train, [f"output_dir={ppep}", "parallel.pp=2", "parallel.ep=2", "parallel.pp_microbatches=2",
                             f"checkpoint.load_from={ep4}/checkpoints/step-2"], timeout=240)
    assert sorted(last_loss_per_step(ppep)) == [3, 4]
    assert_losses_match(last_loss_per_step(ref), last_loss_per_step(ppep), range(3, 5), rel=REL)
    _assert_records_match(ref, ppep, range(3, 5))


@pytest.mark.parametrize("override, message", [
    ("parallel.pp=2 parallel.tp=2", "parallel.tp=2 with model.moe is not supported yet"),
    ("parallel.pp=2 model.n_layers=1", "parallel.pp=2 with parallel.pp_schedule=1F1B (2 stages) and "
                                       "model.n_layers=1: 2 pipeline stages need at least as many layers"),
    ("parallel.pp=2 parallel.pp_microbatches=3", "parallel.pp_microbatches=3 does not divide the per-rank "
                                                 "micro-batch of 4 samples"),
])
def test_moe_pipeline_config_checks(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(compose_config([*MOE, *override.split()]), 4)
    validate_config(compose_config([*MOE, "parallel.pp=2", "parallel.ep=2"]), 4)  # no longer refused
