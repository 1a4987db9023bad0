"""DeepSeek-V3's loss-free balancing in the recipe (``model.moe.expert_bias_update_rate``): the
routers' biases move after each optimizer step from the step's token counts summed over the
data-parallel ranks, are saved, and a resumed run continues with them."""

from __future__ import annotations

from typing import List

import torch
import torch.distributed as dist

from hyper_parallel.checkpoint import load
from hyper_parallel.models.moe import build_moe
from hyper_parallel.platform import get_platform
from hyper_parallel.trainer import compose_config, run_training, validate_config
from tests.multirank import run_on_ranks
from tests.recipes.launch import assert_losses_match, last_loss_per_step

BIAS = ["model=moe_debug", "model.moe.expert_bias_update_rate=0.05", "model.moe.aux_loss_weight=0",
        "training.seq_len=32", "training.global_batch_size=8", "training.steps=4", "optim.lr=1e-2",
        "optim.warmup_steps=1", "logging.log_every=1", "checkpoint.interval=2", "eval.every=1", "eval.steps=1"]


def _train(overrides: List[str]) -> None:
    run_training(validate_config(compose_config([*BIAS, *overrides]), dist.get_world_size()), get_platform())


def _biases(folder: str) -> List[torch.Tensor]:
    names = [f"layers.{i}.moe.router.expert_bias" for i in range(2)]
    state = {"model": {name: torch.zeros(8) for name in names}}
    load(state, checkpoint_id=folder, no_dist=True)
    return [state["model"][name] for name in names]


def test_expert_bias_moves_with_the_global_counts_and_resumes(tmp_path):
    two, one, resumed = (str(tmp_path / name) for name in ("two", "one", "resumed"))
    # Two ranks with ep=2 against one process on the same batches: the same
    # biases (the counts are summed over the data-parallel ranks, not each rank's own), with an
    # evaluation after every step (its forwards do not count).
    run_on_ranks(2, _train, [f"output_dir={two}", "parallel.ep=2"], timeout=180)
    run_on_ranks(1, _train, [f"output_dir={one}"], timeout=180)
    assert sorted(last_loss_per_step(two)) == [1, 2, 3, 4]
    assert_losses_match(last_loss_per_step(one), last_loss_per_step(two), rel=1e-5)
    # (A bias may come back to exactly 0 after an even number of updates: every step's biases
    # are compared, and some must have moved.)
    moved = False
    for step in (2, 4):
        for a, b in zip(_biases(f"{one}/checkpoints/step-{step}"), _biases(f"{two}/checkpoints/step-{step}")):
            assert torch.allclose(a, b, rtol=0, atol=1e-6), (step, a, b)
            moved |= bool(a.abs().sum() > 0)
    assert moved, "the expert biases never moved"
    # The step-2 biases are in the checkpoint: a resumed run continues the uninterrupted losses.
    run_on_ranks(1, _train, [f"output_dir={resumed}", f"checkpoint.load_from={two}/checkpoints/step-2"],
                 timeout=180)
    assert_losses_match(last_loss_per_step(two), last_loss_per_step(resumed), range(3, 5), rel=1e-5)


def test_only_forwards_with_gradients_count_towards_the_bias():
    model = build_moe("moe_debug", expert_bias_update_rate=0.1)
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        model(tokens)
    assert all(int(moe.pending_tokens_per_expert.sum()) == 0 for moe in model.moe_layers().values())
    model(tokens)
    assert all(int(moe.pending_tokens_per_expert.sum()) == 2 * 16 * 2 for moe in model.moe_layers().values())
