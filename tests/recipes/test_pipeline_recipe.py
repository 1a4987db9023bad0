"""Pipeline parallelism in the recipe, in-process on the shared gloo rank pools and in float64
(see tests/fully_shard/_helpers.py, [Note: parity in float64]): PP2 x FSDP2 trains the losses
of plain FSDP on the same global batch, a checkpoint crosses PP2 x FSDP2 -> FSDP2 and
FSDP2 -> PP2 x TP2 with the uninterrupted losses, a SIGTERM on the first stage is agreed by
every stage; the mesh; and the layouts pipeline parallelism refuses."""

from __future__ import annotations

import itertools
import os
import signal
import sys
from typing import List

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.checkpoint import CheckpointManager
from hyper_parallel.platform import get_platform
from hyper_parallel.trainer import ParallelDims, compose_config, loop, run_training, validate_config
from hyper_parallel.trainer.parallelize import build_mesh, dp_mesh
from tests.multirank import run_on_ranks
from tests.recipes.launch import TINY, last_loss_per_step, read_metrics, run
from tests.recipes.train_in_process import one_line_error

STEPS = ["training.steps=5", "training.max_grad_norm=0.3", "checkpoint.interval=1", "checkpoint.keep_last_n=6", "eval.every=2", "eval.steps=1"]
PP2_FSDP2 = ["parallel.pp=2", "training.grad_accum_steps=2", "parallel.pp_microbatches=2"]
PP2_TP2 = ["parallel.pp=2", "parallel.tp=2"]
REL = 1e-6  # float64: only the order of the sums differs between layouts


def _train(overrides: List[str], signal_rank: int = -1):
    """The recipe in float64; ``signal_rank`` sends itself SIGTERM in its second pipelined step."""
    original, calls = loop.pipelined_step, []

    def signalled(*args, **kwargs):
        calls.append(None)
        if dist.get_rank() == signal_rank and len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    loop.pipelined_step = signalled
    torch.set_default_dtype(torch.float64)
    try:
        cfg = compose_config([*TINY, *STEPS, *overrides])
        summary = run_training(cfg, validate_config(cfg, dist.get_world_size()), get_platform())
    finally:
        torch.set_default_dtype(torch.float32)
        loop.pipelined_step = original
    return summary.end_step, summary.stop_reason


def _per_step(output_dir: str, key: str):
    return {r["step"]: r[key] for r in read_metrics(output_dir)}


def _assert_close(ref: str, run: str, steps: range):
    """The losses and gradient norms (clipped over all stages) of ``run`` are ``ref``'s."""
    for key in ("loss", "grad_norm"):
        expected, actual = _per_step(ref, key), _per_step(run, key)
        for step in steps:
            assert abs(actual[step] - expected[step]) <= REL * expected[step], (key, step, actual, expected)


def test_pp2_x_fsdp2_trains_the_fsdp_losses_and_resumes_across_pipeline_layouts(tmp_path):
    ref, pp, fsdp, pptp = (str(tmp_path / name) for name in ("ref", "pp", "fsdp", "pptp"))
    assert run_on_ranks(2, _train, [f"output_dir={ref}"], timeout=240) == [(5, None)] * 2
    # PP2 x FSDP2 from scratch, 2 accumulation steps of 2 pipeline micro-batches each (every step clips).
    stopped = run_on_ranks(4, _train, [f"output_dir={pp}", *PP2_FSDP2, "training.stop_after_steps=3"], timeout=240)
    assert stopped == [(3, "stop_after_steps")] * 4
    _assert_close(ref, pp, range(1, 4))
    val = {path: [r["val_loss"] for r in read_metrics(path) if "val_loss" in r] for path in (ref, pp)}
    assert len(val[pp]) == 1 and abs(val[pp][0] - val[ref][0]) <= REL * val[ref][0], val
    # PP2 x FSDP2 step 2 -> FSDP2 on 2 ranks, to the end.
    run_on_ranks(2, _train, [f"output_dir={fsdp}", f"checkpoint.load_from={pp}/checkpoints/step-2"], timeout=240)
    assert sorted(last_loss_per_step(fsdp)) == [3, 4, 5]
    _assert_close(ref, fsdp, range(3, 6))
    # FSDP2 step 2 -> PP2 x TP2 on 4 ranks; the first stage's rank 0 gets SIGTERM in step 4.
    stopped = run_on_ranks(4, _train, [f"output_dir={pptp}", *PP2_TP2, f"checkpoint.load_from={ref}/checkpoints/step-2"],
                           0, timeout=240)
    assert stopped == [(4, "SIGTERM")] * 4
    assert sorted(last_loss_per_step(pptp)) == [3, 4]
    _assert_close(ref, pptp, range(3, 5))
    assert CheckpointManager(os.path.join(pptp, "checkpoints")).committed_steps() == [3, 4]

    listing = run([sys.executable, "-m", "hyper_parallel.checkpoint", "inspect", f"{pptp}/checkpoints"]).stdout
    assert "mesh: pp=2 x dp_replicate=1 x dp_shard=1 x tp=2" in listing, listing
    assert "parallel.pp = 2" in listing, listing


def _mesh_ranks(dims: ParallelDims):
    mesh = build_mesh(dims, "cpu")
    rank = dist.get_rank()
    return (mesh.mesh_dim_names, dp_mesh(mesh).mesh_dim_names, mesh["pp"].get_local_rank(),
            dp_mesh(mesh).get_local_rank() if dims.dp_size > 1 else 0, dims.pp_rank(rank), dims.dp_rank(rank))


@pytest.mark.parametrize("dims, names", [(ParallelDims(1, 2, 1, 2), ("pp", "shard")),
                                         (ParallelDims(1, 1, 2, 2), ("pp", "shard", "tp"))])
def test_the_mesh_puts_pp_outermost_and_dp_rank_follows_it(dims, names):
    for mesh_names, dp_names, pp_local, dp_local, pp_rank, dp_rank in run_on_ranks(4, _mesh_ranks, dims, timeout=60):
        assert mesh_names == names and dp_names == ("shard",)
        assert (pp_local, dp_local) == (pp_rank, dp_rank)


def test_dp_rank_and_pp_rank_are_the_row_major_coordinates():
    dims = ParallelDims(replicate=2, shard=3, tp=2, pp=2)
    coords = itertools.product(range(2), range(2), range(3), range(2))  # (pp, replicate, shard, tp)
    for rank, (p, r, s, _) in enumerate(coords):
        assert (dims.pp_rank(rank), dims.dp_rank(rank)) == (p, r * 3 + s), rank
    assert dims.world_size == 24 and dims.loss_ranks == 12


@pytest.mark.parametrize("overrides, expected", [
    (["parallel.pp=3"], "parallel.pp=3 does not divide the world size 2"),
    (["parallel.pp=2", "parallel.dp_shard=2"],
     "parallel.pp=2 x parallel.dp_replicate=1 x parallel.dp_shard=2 does not factor the world size 2"),
    (["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B"],
     "parallel.pp=2 with parallel.pp_schedule=Interleaved1F1B (4 stages) and model.n_layers=2"),
    (["parallel.pp=2", "parallel.pp_layers_per_stage=[1,2]"], "parallel.pp_layers_per_stage=[1, 2] with parallel.pp=2"),
    (["parallel.pp=2", "model.tie_embeddings=true"], "model.tie_embeddings=true with parallel.pp=2 is not supported"),
    (["parallel.pp=2", "parallel.pp_microbatches=3"],
     "parallel.pp_microbatches=3 does not divide the per-rank micro-batch of 16 samples"),
    (["parallel.pp=2", "training.global_batch_size=6"],
     "parallel.pp_microbatches=null (2 x 2 stages = 4) does not divide the per-rank micro-batch of 6 samples"),
    (["parallel.pp=2", "parallel.pp_microbatches=1"], "parallel.pp_microbatches=1 is fewer than parallel.pp=2"),
    (["parallel.pp=2", "parallel.pp_schedule=GPipe2"], "parallel.pp_schedule='GPipe2' must be one of 1F1B, GPipe"),
    (["parallel.pp=2", "training.float8=true"], "training.float8=true with parallel.pp=2 is not supported yet"),
])
def test_impossible_pipeline_layouts_are_refused_in_one_line(check, overrides, expected):
    one_line_error(*check(*overrides)[::2], expected)
