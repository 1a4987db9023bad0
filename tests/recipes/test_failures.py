"""Problems found after the ranks started, on 2 gloo ranks in-process: every rank stops at the
same point (no hang), the ranks that found the problem report it, the others stay quiet."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hyper_parallel.checkpoint import CheckpointManager, ModelState, committed_steps, load
from hyper_parallel.data import TokenWindows
from hyper_parallel.models.llama import Transformer
from hyper_parallel.platform import get_platform
from hyper_parallel.trainer import compose_config, run_training, validate_config
from hyper_parallel.trainer.step.agreement import JobFailed
from hyper_parallel.trainer.config import ConfigError, llama_config
from tests.multirank import run_on_ranks
from tests.recipes.launch import TINY


def _train(overrides):
    """Run the recipe's training on this rank; its report line if it failed ("ok" if not)."""
    cfg = compose_config([*TINY, *overrides])
    try:
        run_training(validate_config(cfg, dist.get_world_size()), get_platform())
    except JobFailed as failure:
        return failure.report(dist.get_rank(), dist.get_world_size())
    return "ok"


def test_a_bad_token_on_one_rank_is_reported_by_that_rank_only(tmp_path):
    tokens = np.zeros(4000, dtype=np.uint16)
    tokens[3900] = 300  # in rank 1's half of the file; llama_debug's vocab_size is 256
    tokens.tofile(tmp_path / "tokens.bin")
    reports = run_on_ranks(2, _train, [f"output_dir={tmp_path}/out", "data=tokens",
                                       f"data.path={tmp_path}/tokens.bin"], timeout=120)
    assert reports[0] is None
    assert reports[1].startswith("(rank 1 of 2) data=tokens: ") and "token id 300 is outside" in reports[1]
    assert "token 3,900 of 4,000" in reports[1]
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")  # found before the first step


def _train_without_upfront_validation(overrides):
    """As _train, with the pre-training scan off: the batch check inside the loop must catch it."""
    original = TokenWindows.validate
    TokenWindows.validate = lambda self, part, parts: None
    try:
        return _train(overrides)
    finally:
        TokenWindows.validate = original


def test_a_bad_batch_mid_run_stops_every_rank_after_the_last_good_step(tmp_path):
    tokens = np.zeros(4000, dtype=np.uint16)
    tokens[3750] = 300  # in sample 117 (tokens 3744..3776): global batch 14, rank 1's half, step 15
    tokens.tofile(tmp_path / "tokens.bin")
    reports = run_on_ranks(2, _train_without_upfront_validation,
                           [f"output_dir={tmp_path}/out", "data=tokens", "data.shuffle=false",
                            f"data.path={tmp_path}/tokens.bin", "training.steps=20"], timeout=120)
    assert reports[0] is None
    assert reports[1].startswith("(rank 1 of 2) data=tokens, step 15: ") and "token id 300" in reports[1], reports
    steps = [json.loads(line)["step"] for line in open(tmp_path / "out" / "metrics.jsonl")]
    assert steps == list(range(1, 15))


def test_the_first_token_out_of_range_is_found_before_training(tmp_path):
    tokens = np.zeros(4000, dtype=np.uint16)
    tokens[0] = 256
    tokens.tofile(tmp_path / "tokens.bin")
    reports = run_on_ranks(2, _train, [f"output_dir={tmp_path}/out", "data=tokens", "data.shuffle=false",
                                       f"data.path={tmp_path}/tokens.bin"], timeout=120)
    assert reports[1] is None and "(rank 0 of 2)" in reports[0] and "token id 256 is outside" in reports[0]


def test_a_non_finite_loss_stops_the_run_and_is_never_saved(tmp_path):
    out = tmp_path / "out"
    reports = run_on_ranks(2, _train, [f"output_dir={out}", "optim.lr=1e10", "training.steps=30",
                                       "checkpoint.interval=1", "checkpoint.keep_last_n=2"], timeout=120)
    assert reports[1] is None
    assert "training diverged, and this step was not saved" in reports[0], reports
    failed_step = int(reports[0].split(":")[0].split()[1])
    folder = str(out / "checkpoints")
    for step in CheckpointManager(folder).committed_steps():
        assert step < failed_step
        model = Transformer(llama_config(compose_config(TINY).model))
        state = {"model": ModelState(model).state_dict()}
        load(state, checkpoint_id=os.path.join(folder, f"step-{step}"), no_dist=True)
        model.load_state_dict(state["model"])
        assert all(torch.isfinite(p).all() for p in model.parameters()), f"step-{step} holds non-finite values"


def test_resuming_with_another_model_or_batch_names_the_difference(tmp_path):
    out = f"output_dir={tmp_path}"
    assert run_on_ranks(2, _train, [out, "training.steps=2"], timeout=120) == ["ok", "ok"]
    reports = run_on_ranks(2, _train, [out, "training.steps=4", "model.dim=64"], timeout=120)
    assert reports[1] is None
    assert reports[0] == (f"cannot resume from {tmp_path}/checkpoints/step-2 (model.dim: saved 32, now 64). "
                          "For a new run use a new output_dir (or checkpoint.folder); to continue that run use "
                          "the settings it was written with")
    reports = run_on_ranks(2, _train, [out, "training.steps=4", "training.global_batch_size=4"], timeout=120)
    assert reports[1] is None and "global_batch_size: saved 8, now 4" in reports[0], reports


def test_resuming_with_fewer_layers_or_toggled_tied_embeddings_names_the_difference(tmp_path):
    # Fewer parameters than the checkpoint (fewer layers, or a tied output head) is the same one
    # line as more parameters, not the optimizer's KeyError.
    for i, (first, changed, detail) in enumerate([(["model.n_layers=2"], "model.n_layers=1", "model.n_layers: saved 2, now 1"),
                                   (["model.tie_embeddings=false"], "model.tie_embeddings=true",
                                    "model.tie_embeddings: saved False, now True"),
                                   (["model.tie_embeddings=true"], "model.tie_embeddings=false",
                                    "model.tie_embeddings: saved True, now False")]):
        out = f"output_dir={tmp_path / str(i)}"
        assert run_on_ranks(2, _train, [out, "training.steps=1", *first], timeout=120) == ["ok", "ok"]
        reports = run_on_ranks(2, _train, [out, "training.steps=2", changed], timeout=120)
        assert reports[1] is None and reports[0] is not None and "\n" not in reports[0], reports
        assert reports[0].startswith(f"cannot resume from {tmp_path / str(i)}/checkpoints/step-1 ({detail}). "), reports


def test_job_failed_reports():
    err = ConfigError("bad")
    assert JobFailed(err, 1).report(1, 4) == "(rank 1 of 4) bad"
    assert JobFailed(None, 1).report(0, 4) is None
    assert JobFailed(err, 4).report(0, 4) == "bad" and JobFailed(err, 4).report(2, 4) is None
    assert JobFailed(err, 1).report(0, 1) == "bad"


def _train_steps(overrides):
    """Run the recipe's training on this rank: (first step, last step) of the run."""
    cfg = compose_config([*TINY, *overrides])
    summary = run_training(validate_config(cfg, dist.get_world_size()), get_platform())
    return summary.start_step, summary.end_step


def test_a_corrupt_latest_checkpoint_resumes_from_the_previous_one(tmp_path):
    out = [f"output_dir={tmp_path}/out", "checkpoint.interval=2"]
    assert run_on_ranks(2, _train_steps, [*out, "training.steps=4"], timeout=120) == [(0, 4)] * 2
    data = tmp_path / "out" / "checkpoints" / "step-4" / "__0_0.safetensors"
    corrupt = bytearray(data.read_bytes())
    corrupt[-1] ^= 0xFF  # a flipped bit in the last tensor's data
    data.write_bytes(bytes(corrupt))
    assert run_on_ranks(2, _train_steps, [*out, "training.steps=6"], timeout=120) == [(2, 6)] * 2


def test_a_bad_token_in_the_validation_split_is_found_before_training(tmp_path):
    tokens = np.zeros(4000, dtype=np.uint16)
    # 124 samples of 32, the last 12 held out: tokens 3,584 to the end; 3,804 is in rank 1's half
    # of the split and in its slice of the first validation batch (sample 6).
    tokens[3804] = 300
    tokens.tofile(tmp_path / "tokens.bin")
    reports = run_on_ranks(2, _train, [f"output_dir={tmp_path}/out", "data=tokens", f"data.path={tmp_path}/tokens.bin",
                                       "data.val_fraction=0.1", "eval.every=5", "eval.steps=1"], timeout=120)
    assert reports[0] is None
    assert reports[1] == (f"(rank 1 of 2) data=tokens: {tmp_path}/tokens.bin (validation split: its tokens 3,584 "
                          "to the end): token id 300 is outside the model's vocab_size=256 (token 220 of 416)")
    assert not os.path.exists(tmp_path / "out" / "metrics.jsonl")  # found before the first step


def _train_with_a_full_disk(overrides):
    """As _train, with rank 1's writes of the second checkpoint failing with ENOSPC."""
    import errno

    from hyper_parallel.core.distributed_checkpoint.filesystem import writer as filesystem

    original, saves = filesystem.write_safetensors, set()

    def write(path, *args, **kwargs):
        saves.add(os.path.dirname(path))
        if dist.get_rank() == 1 and len(saves) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return original(path, *args, **kwargs)

    filesystem.write_safetensors = write
    try:
        return _train(overrides)
    finally:
        filesystem.write_safetensors = original


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_is_one_line_and_the_earlier_checkpoint_is_intact(tmp_path, async_save):
    out = tmp_path / "out"
    reports = run_on_ranks(2, _train_with_a_full_disk, [f"output_dir={out}", "training.steps=4",
                                                        "checkpoint.interval=2", f"checkpoint.async_save={async_save}"],
                           timeout=120)
    folder = out / "checkpoints"
    assert reports[0] is None and "\n" not in reports[1], reports
    assert reports[1].startswith(f"(rank 1 of 2) no space left on device while saving the checkpoint of step 4 "
                                 f"to {folder}: it needs about "), reports
    assert "are free; the previous checkpoints (step-2) are intact and nothing of step 4 was kept" in reports[1]
    assert committed_steps(folder) == [2]
    assert sorted(os.listdir(folder)) == [".hyper_parallel.lock", "step-2"]  # no part of step 4 left
    model = Transformer(llama_config(compose_config(TINY).model))
    state = {"model": ModelState(model).state_dict()}
    load(state, checkpoint_id=str(folder / "step-2"), no_dist=True)  # loads, checksums verified
