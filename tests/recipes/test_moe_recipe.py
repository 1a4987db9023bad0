"""The recipe with a mixture-of-experts model (``model=moe_debug``): sharded training against one
process, its config checks. In-process on the shared gloo rank pools."""

from __future__ import annotations

from typing import List

import pytest
import torch.distributed as dist

from hyper_parallel.platform import get_platform
from hyper_parallel.trainer import compose_config, run_training, validate_config
from hyper_parallel.trainer.config.compose import ConfigError
from tests.multirank import run_on_ranks
from tests.recipes.launch import assert_losses_match, last_loss_per_step, read_metrics

MOE = ["model=moe_debug", "training.seq_len=32", "training.global_batch_size=8", "training.steps=4",
       "optim.lr=1e-2", "optim.warmup_steps=1", "logging.log_every=1", "checkpoint.interval=100"]


def _train(overrides: List[str]) -> None:
    cfg = compose_config([*MOE, *overrides])
    run_training(validate_config(cfg, dist.get_world_size()), get_platform())


def test_fsdp2_matches_one_process_with_the_aux_loss(tmp_path):
    # Each rank balances its own tokens, so one process with two micro-batches (the two ranks'
    # halves of the batch) is the same training as FSDP on 2 ranks.
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    run_on_ranks(1, _train, [f"output_dir={one}", "training.grad_accum_steps=2"], timeout=180)
    run_on_ranks(2, _train, [f"output_dir={two}"], timeout=180)
    expected = last_loss_per_step(one)
    assert sorted(expected) == [1, 2, 3, 4] and expected[4] < expected[1]
    assert_losses_match(expected, last_loss_per_step(two), rel=1e-5)
    # The aux loss is in the backward: without it the same run trains differently.
    plain = str(tmp_path / "plain")
    run_on_ranks(1, _train, [f"output_dir={plain}", "training.grad_accum_steps=2", "model.moe.aux_loss_weight=0"],
                 timeout=180)
    unbalanced = last_loss_per_step(plain)
    assert unbalanced[1] == expected[1] and abs(unbalanced[4] - expected[4]) > 1e-5 * expected[4]


@pytest.mark.parametrize("override, message", [
    ("model.moe.top_k=9", "model.moe: top_k=9 is more than num_experts=8"),
    ("model.moe.first_k_dense=1", "model.moe: first_k_dense=1 dense blocks need ffn_hidden_dim > 0"),
    ("parallel.tp=2", "parallel.tp=2 with model.moe is not supported yet"),
    ("model.init_from=/x", "model.init_from=/x is not supported with model.moe"),
])
def test_moe_config_refusals(override, message):
    with pytest.raises(ConfigError, match="^" + message.replace(".", r"\.") .replace("(", r"\(")):
        validate_config(compose_config([*MOE, override]), 2)
