"""Pipeline parallelism in the recipe, in-process on the shared gloo rank pools and in float64
(see tests/fully_shard/_helpers.py, [Note: parity in float64]): PP2 x FSDP2 trains the losses
of plain FSDP on the same global batch, a checkpoint crosses PP2 x FSDP2 -> FSDP2 and
FSDP2 -> PP2 x TP2 with the uninterrupted losses, a SIGTERM on the first stage and a bad batch
on one data-parallel rank are agreed by every stage; each schedule and split against the plain
model; the mesh, the start-up line, the memory estimate, ``model.init_from``; and the layouts
pipeline parallelism refuses."""

from __future__ import annotations

import itertools
import os
import signal
import sys
from typing import List

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.checkpoint import CheckpointManager, export_hf
from hyper_parallel.platform import get_platform
from hyper_parallel.trainer import ParallelDims, compose_config, loop, run_training, validate_config
from hyper_parallel.trainer.setup.parallelize import build_mesh, dp_mesh
from tests.multirank import run_on_ranks
from tests.recipes.launch import TINY, last_loss_per_step, read_metrics, run
from tests.recipes.train_in_process import one_line_error

STEPS = ["training.steps=5", "training.max_grad_norm=0.3", "checkpoint.interval=2", "checkpoint.keep_last_n=6",
         "eval.every=2", "eval.steps=1"]
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
        summary = run_training(validate_config(cfg, dist.get_world_size()), get_platform())
    finally:
        torch.set_default_dtype(torch.float32)
        loop.pipelined_step = original
    return summary.end_step, summary.stop_reason


def _export(checkpoint: str, out: str):
    from safetensors.torch import load_file

    export_hf(checkpoint, out)
    return {k: v for file in sorted(os.listdir(out)) if file.endswith(".safetensors")
            for k, v in load_file(os.path.join(out, file)).items()}


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
    # The PP checkpoint holds the whole model under its usual names: its HF export is FSDP's.
    exported = [_export(f"{run}/checkpoints/step-2", str(tmp_path / f"hf-{i}")) for i, run in enumerate((ref, pp))]
    assert sorted(exported[0]) == sorted(exported[1]) and "tok_embeddings.weight" in exported[1]
    assert all(torch.allclose(exported[0][k], exported[1][k], rtol=1e-9, atol=0) for k in exported[0])
    # PP2 x FSDP2 step 2 -> FSDP2 on 2 ranks, to the end.
    run_on_ranks(2, _train, [f"output_dir={fsdp}", f"checkpoint.load_from={pp}/checkpoints/step-2"], timeout=240)
    assert sorted(last_loss_per_step(fsdp)) == [3, 4, 5]
    _assert_close(ref, fsdp, range(3, 6))
    # FSDP2 step 2 -> PP2 x TP2 on 4 ranks; the first stage's rank 0 gets SIGTERM in step 4.
    stopped = run_on_ranks(4, _train, [f"output_dir={pptp}", *PP2_TP2,
                                       f"checkpoint.load_from={ref}/checkpoints/step-2"], 0, timeout=240)
    assert stopped == [(4, "SIGTERM")] * 4
    assert sorted(last_loss_per_step(pptp)) == [3, 4]
    _assert_close(ref, pptp, range(3, 5))
    assert CheckpointManager(os.path.join(pptp, "checkpoints")).committed_steps() == [4]

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


def _describe(overrides: List[str]) -> str:
    from hyper_parallel.trainer.launch.reporting import describe

    config = validate_config(compose_config([*TINY, *overrides]), dist.get_world_size())
    return describe(loop.build_job(config.cfg, config.dims, get_platform()))


def test_the_start_up_line_counts_the_whole_model_and_this_ranks_stages(tmp_path):
    lines = run_on_ranks(2, _describe, [f"output_dir={tmp_path}", "parallel.pp=2", "parallel.pp_microbatches=2"],
                         timeout=60)
    assert [line.split(", mesh")[0] for line in lines] == [
        "model llama_debug with dim=32: 41,120 parameters (20,544 in stage(s) [0] of 2 on this rank)",
        "model llama_debug with dim=32: 41,120 parameters (20,576 in stage(s) [1] of 2 on this rank)"]
    assert "mesh 2x1 (pp, shard), pipeline 1F1B with 2 micro-batches, fp32" in lines[0]


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
    (["parallel.pp=2", "parallel.pp_schedule=GPipe2"], "parallel.pp_schedule='GPipe2' must be null or one of 1F1B, GPipe"),
    (["parallel.pp_schedule=GPipe"], "parallel.pp_schedule=GPipe needs parallel.pp > 1 (it has no effect"),
    (["parallel.pp=2", "training.float8=true"], "training.float8=true with parallel.pp=2 is not supported yet"),
    (["parallel.pp_microbatches=4", "parallel.pp_layers_per_stage=[1,1]"],
     "parallel.pp_microbatches=4, parallel.pp_layers_per_stage=[1, 1] needs parallel.pp > 1 (it has no effect"),
])
def test_impossible_pipeline_layouts_are_refused_in_one_line(check, overrides, expected):
    one_line_error(*check(*overrides)[::2], expected)


def _stages_vs_plain(overrides: List[str]):
    """Two steps of this rank's pipeline stages (on its data-parallel slice) and of the plain
    model on the same global batches, in float64: the names each rank's stages hold, the
    largest parameter difference after init, and (loss, reference loss, grad norm, reference
    grad norm) per step."""
    from hyper_parallel.data import DistributedBatchLoader, MarkovSource
    from hyper_parallel.trainer import train_step
    from hyper_parallel.trainer.setup.optimizer import build_optimizer
    from hyper_parallel.trainer.setup.parallelize import build_model
    from hyper_parallel.trainer.setup.pipeline_parallel import build_pipeline, pipelined_step

    torch.set_default_dtype(torch.float64)
    try:
        composed = compose_config([*TINY, "training.global_batch_size=4", "optim.warmup_steps=0", *overrides])
        config = validate_config(composed, dist.get_world_size())
        dims, cfg = config.dims, config.cfg
        t, cpu = cfg.training, torch.device("cpu")
        plain = build_model(cfg.model, mesh=None, device=cpu, seed=t.seed)
        pipeline = build_pipeline(cfg.model, cfg.parallel, mesh=build_mesh(dims, "cpu"), device=cpu, seed=t.seed,
                                  grad_accum_steps=t.grad_accum_steps, loss_chunks=t.loss_chunks,
                                  compile_backend=t.compile_backend if t.compile else None)
        reference = dict(plain.named_parameters())
        names = sorted({n.split(".")[0] + (f".{n.split('.')[1]}" if n.startswith("layers") else "")
                        for part in pipeline.parts for n, _ in part.named_parameters()})
        init_diff = max((p.full_tensor() - reference[n]).abs().max().item()
                        for part in pipeline.parts for n, p in part.named_parameters())
        opt_plain, opt_pp = build_optimizer(plain, cfg.optim), build_optimizer(pipeline.parts, cfg.optim)
        source = MarkovSource(cfg.model.vocab_size, t.seq_len, seed=1)
        whole = DistributedBatchLoader(source, t.global_batch_size)
        mine = DistributedBatchLoader(source, t.global_batch_size, dp_rank=dims.dp_rank(dist.get_rank()),
                                      dp_size=dims.dp_size)
        steps = []
        for _ in range(2):
            ref = train_step(plain, whole.next_batch(), opt_plain, grad_accum_steps=1, max_grad_norm=0.3)
            got = pipelined_step(pipeline, mine.next_batch(), opt_pp, max_grad_norm=0.3)
            loss = got["loss"].clone()
            dist.all_reduce(loss)
            steps.append((float(loss) / dims.loss_ranks, float(ref["loss"]), float(got["grad_norm"]),
                          float(ref["grad_norm"])))
        return pipeline.stage_indices, names, init_diff, steps
    finally:
        torch.set_default_dtype(torch.float32)


@pytest.mark.parametrize("overrides, held", [
    (["parallel.pp_schedule=Interleaved1F1B", "parallel.pp_microbatches=4", "model.activation_checkpointing=true",
      "training.compile=true", "training.compile_backend=aot_eager", "training.loss_chunks=3"],
     [([0, 2], ["layers.0", "layers.2", "tok_embeddings"]), ([1, 3], ["layers.1", "layers.3", "norm", "output"])]),
    (["parallel.pp_schedule=GPipe", "parallel.pp_layers_per_stage=[1,3]", "training.grad_accum_steps=2",
      "parallel.pp_microbatches=2", "training.loss_chunks=2"],
     [([0], ["layers.0", "tok_embeddings"]), ([1], ["layers.1", "layers.2", "layers.3", "norm", "output"])]),
    # PP2 x HSDP 2x1 on 4 ranks: a stage's ranks are a contiguous block.
    (["parallel.dp_replicate=2", "parallel.pp_microbatches=2"],
     [([0], ["layers.0", "layers.1", "tok_embeddings"])] * 2 + [([1], ["layers.2", "layers.3", "norm", "output"])] * 2),
], ids=["interleaved-ac-compiled-loss-chunks", "gpipe-uneven-accum-loss-chunks", "1f1b-hsdp"])
def test_each_schedule_and_split_trains_the_plain_models_losses(overrides, held):
    results = run_on_ranks(len(held), _stages_vs_plain, ["parallel.pp=2", "model.n_layers=4", *overrides], timeout=120)
    assert [(indices, names) for indices, names, _, _ in results] == held
    for _, _, init_diff, steps in results:
        assert init_diff == 0  # every stage initialised to the whole model's values
        for loss, ref_loss, norm, ref_norm in steps:
            assert abs(loss - ref_loss) <= REL * ref_loss and abs(norm - ref_norm) <= REL * ref_norm, steps


def test_the_memory_estimate_counts_one_stage_one_end_of_the_model_and_one_pipeline_micro_batch():
    from hyper_parallel.trainer.launch.preflight import estimate_memory

    estimates = {}
    for pp in (1, 2):  # llama_8b: the embedding and the output outweigh a block
        cfg = compose_config(["model=llama_8b", "data.path=corpus.bin", "data=tokens", f"parallel.pp={pp}"])
        config = validate_config(cfg, 4 * pp)
        estimates[pp] = estimate_memory(config.cfg, config.dims)
    one, two = estimates[1], estimates[2]
    assert two.parameters == one.parameters and two.model_state * 2 == one.model_state
    assert two.gathered * 2 == one.gathered and two.logits * 4 == one.logits  # 4 samples per rank, 4 micro-batches


def _init_from_diff(path: str) -> float:
    """The largest difference between this rank's stages initialised from the transformers
    export at ``path`` and the plain model it was exported from (seed 3)."""
    from hyper_parallel.trainer.setup.parallelize import build_model
    from hyper_parallel.trainer.setup.pipeline_parallel import build_pipeline

    composed = compose_config([*TINY, "parallel.pp=2", "parallel.pp_microbatches=2", f"model.init_from={path}"])
    config = validate_config(composed, dist.get_world_size())
    dims, cfg = config.dims, config.cfg
    pipeline = build_pipeline(cfg.model, cfg.parallel, mesh=build_mesh(dims, "cpu"), device=torch.device("cpu"),
                              seed=0, grad_accum_steps=1)
    cfg.model.init_from = None
    plain = dict(build_model(cfg.model, mesh=None, device=torch.device("cpu"), seed=3).named_parameters())
    return max((p.full_tensor() - plain[n]).abs().max().item()
               for part in pipeline.parts for n, p in part.named_parameters())


def test_init_from_a_transformers_export_fills_each_stage(tmp_path):
    import json

    from safetensors.torch import save_file

    from hyper_parallel.models import hf_llama
    from hyper_parallel.models.llama import Transformer
    from hyper_parallel.trainer.config import llama_config

    cfg = llama_config(compose_config(TINY).model)
    model = Transformer(cfg)
    model.init_weights(seed=3)
    save_file(dict(item for item in (hf_llama.to_hf(k, v, cfg) for k, v in model.state_dict().items()) if item),
              tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(hf_llama.hf_config(cfg, torch.float32)))
    assert run_on_ranks(2, _init_from_diff, str(tmp_path), timeout=120) == [0.0, 0.0]


def test_a_bad_batch_mid_run_stops_every_stage_after_the_last_good_step(tmp_path):
    import numpy as np

    from tests.recipes.test_failures import _train_without_upfront_validation

    tokens = np.zeros(4000, dtype=np.uint16)
    tokens[3750] = 300  # step 15, data-parallel rank 1: global ranks 1 (stage 0) and 3 (stage 1)
    tokens.tofile(tmp_path / "tokens.bin")
    reports = run_on_ranks(4, _train_without_upfront_validation,
                           [f"output_dir={tmp_path}/out", "data=tokens", "data.shuffle=false", "parallel.pp=2",
                            f"data.path={tmp_path}/tokens.bin", "training.steps=20"], timeout=120)
    assert reports[0] is None and reports[2] is None, reports
    for rank in (1, 3):
        assert reports[rank].startswith(f"(rank {rank} of 4) data=tokens, step 15: ") and "token id 300" in reports[rank]
    assert [r["step"] for r in read_metrics(str(tmp_path / "out"))] == list(range(1, 15))
