"""Checkpoints across N-D meshes: a checkpoint saved on one (dp_replicate, dp_shard, tp) layout
loads every model and optimizer tensor bit-exactly on another, and a job resumed on another
layout continues the uninterrupted run's losses (data order and LR included); a transformers
export initialises a tensor-parallel model. In-process on the shared gloo rank pools."""

from __future__ import annotations

import sys
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from safetensors.torch import load_file

from hyper_parallel.checkpoint import export_hf
from hyper_parallel.platform import get_platform
from hyper_parallel.trainer import compose_config, loop, run_training, validate_config
from tests.multirank import run_on_ranks
from tests.recipes.launch import TINY, assert_losses_match, last_loss_per_step, read_metrics, run

FSDP4, FSDP2 = [], []
TP2_FSDP2 = ["parallel.tp=2"]
HSDP2_TP2 = ["parallel.tp=2", "parallel.dp_replicate=2"]


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _full_state(job: loop.TrainingJob) -> Dict[str, torch.Tensor]:
    """Every model parameter and optimizer state tensor, gathered whole, by parameter name."""
    tensors = {}
    for name, param in job.model.named_parameters():
        tensors[f"model.{name}"] = _full(param).detach().clone()
        for key, value in job.optimizer.state[param].items():
            tensors[f"optim.{name}.{key}"] = _full(value).clone()
    return tensors


def _job(overrides: List[str]) -> loop.TrainingJob:
    config = validate_config(compose_config([*TINY, *overrides]), dist.get_world_size())
    return loop.build_job(config.cfg, config.dims, get_platform())


def _train_and_save(overrides: List[str]) -> Dict[str, torch.Tensor]:
    """Two steps on this layout, a checkpoint of step 2; the full tensors it holds."""
    job = _job(overrides)
    t = job.cfg.training
    for step in (1, 2):
        job.schedule.step()
        loop.train_step(job.model, job.loader.next_batch(), job.optimizer, grad_accum_steps=t.grad_accum_steps,
                        max_grad_norm=t.max_grad_norm)
    # Without the "parallel" entry, as checkpoints were written before they recorded their mesh:
    # a resumed job must not need it.
    job.manager.save(2, {k: v for k, v in job.state.items() if k != "parallel"}, force=True)
    job.manager.wait()
    tensors = _full_state(job)  # collective: every rank gathers
    return tensors if dist.get_rank() == 0 else {}


def _load(overrides: List[str]) -> Dict[str, torch.Tensor]:
    job = _job(overrides)
    plan = loop.resume(job)
    assert plan is not None and plan.start_step == 2, plan
    tensors = _full_state(job)  # collective: every rank gathers
    return tensors if dist.get_rank() == 0 else {}


@pytest.mark.parametrize("saved, loaded", [
    pytest.param((4, TP2_FSDP2), (4, HSDP2_TP2), marks=pytest.mark.slow),  # HSDP x TP: the next case
    ((4, HSDP2_TP2), (2, FSDP2)),
    ((2, TP2_FSDP2 + ["parallel.dp_shard=1"]), (4, TP2_FSDP2)),
], ids=["tp2xfsdp2-to-hsdp2xtp2", "hsdp2xtp2-to-fsdp2", "tp2-to-tp2xfsdp2"])
def test_every_tensor_loads_bit_exactly_on_another_layout(tmp_path, saved, loaded):
    out = [f"output_dir={tmp_path}"]
    before = run_on_ranks(saved[0], _train_and_save, out + saved[1], timeout=180)[0]
    after = run_on_ranks(loaded[0], _load, out + loaded[1], timeout=180)[0]
    assert sorted(after) == sorted(before) and any(k.endswith("exp_avg_sq") for k in before)
    unequal = [k for k in before if not torch.equal(before[k], after[k])]
    assert not unequal, unequal
    # The HF export of the saved layout holds the same full weights.
    export_hf(tmp_path / "checkpoints" / "step-2", tmp_path / "hf")
    exported = {}
    for file in (tmp_path / "hf").glob("*.safetensors"):
        exported.update(load_file(file))
    model = {k[len("model."):]: v for k, v in before.items() if k.startswith("model.")}
    assert sorted(exported) == sorted(model)
    assert all(torch.equal(exported[k], model[k]) for k in model)


def _train(overrides: List[str]) -> None:
    cfg = compose_config([*TINY, *overrides])
    run_training(validate_config(cfg, dist.get_world_size()), get_platform())


def test_resume_matrix_fsdp4_to_tp2xfsdp2_to_fsdp2_continues_the_uninterrupted_losses(tmp_path):
    steps = ["training.steps=6", "checkpoint.interval=1", "checkpoint.keep_last_n=6", "eval.every=3",
             "eval.steps=1"]
    ref, tp, fsdp = (str(tmp_path / name) for name in ("ref", "tp", "fsdp"))
    run_on_ranks(4, _train, [f"output_dir={ref}", *steps, *FSDP4], timeout=240)
    # FSDP4 step 2 -> TP2 x FSDP2 on 4 ranks, for two steps.
    run_on_ranks(4, _train, [f"output_dir={tp}", *steps, *TP2_FSDP2, "training.stop_after_steps=2",
                             f"checkpoint.load_from={ref}/checkpoints/step-2"], timeout=240)
    # TP2 x FSDP2 step 4 -> FSDP2 on 2 ranks, to the end.
    run_on_ranks(2, _train, [f"output_dir={fsdp}", *steps, *FSDP2,
                             f"checkpoint.load_from={tp}/checkpoints/step-4"], timeout=240)
    expected = last_loss_per_step(ref)
    assert sorted(last_loss_per_step(tp)) == [3, 4] and sorted(last_loss_per_step(fsdp)) == [5, 6]
    assert_losses_match(expected, last_loss_per_step(tp), range(3, 5))
    assert_losses_match(expected, last_loss_per_step(fsdp), range(5, 7))
    val = {path: [r["val_loss"] for r in read_metrics(path) if "val_loss" in r] for path in (ref, tp, fsdp)}
    assert val[fsdp] and abs(val[fsdp][-1] - val[ref][-1]) <= 1e-4 * val[ref][-1], val

    listing = run([sys.executable, "-m", "hyper_parallel.checkpoint", "inspect", f"{tp}/checkpoints/step-4"]).stdout
    assert "mesh 2x2 (shard,tp) placements [_S(0, 2),S(0)]" in listing, listing



def _init_from(overrides: List[str]) -> float:
    """The largest difference between the plain model and the TP model initialised from its
    transformers export (``model.init_from`` in ``overrides``)."""
    from hyper_parallel.trainer.setup.parallelize import build_mesh, build_model

    config = validate_config(compose_config([*TINY, *overrides]), dist.get_world_size())
    cfg, dims = config.cfg, config.dims
    plain = build_model(cfg.model, mesh=None, device=torch.device("cpu"), seed=3)
    sharded = build_model(cfg.model, mesh=build_mesh(dims, "cpu"), device=torch.device("cpu"), seed=0)
    plain_params = dict(plain.named_parameters())
    return max((_full(p) - plain_params[n]).abs().max().item() for n, p in sharded.named_parameters())


def test_init_from_a_transformers_export_loads_into_tensor_parallel(tmp_path):
    import json

    from safetensors.torch import save_file

    from hyper_parallel.models import hf_llama
    from hyper_parallel.models.llama import Transformer
    from hyper_parallel.trainer.config import llama_config

    cfg = llama_config(compose_config(TINY).model)
    model = Transformer(cfg)
    model.init_weights(seed=3)
    (tmp_path / "hf").mkdir()
    save_file(dict(item for item in (hf_llama.to_hf(k, v, cfg) for k, v in model.state_dict().items()) if item),
              tmp_path / "hf" / "model.safetensors")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_llama.hf_config(cfg, torch.float32)))
    diffs = run_on_ranks(2, _init_from, [*TP2_FSDP2, "parallel.dp_shard=1", f"model.init_from={tmp_path / 'hf'}"],
                         timeout=120)
    assert diffs == [0.0, 0.0], diffs
