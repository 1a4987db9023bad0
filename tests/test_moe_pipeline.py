"""A mixture of experts under pipeline parallelism, in float64 on gloo ranks: the recipe's
pipeline (``build_pipeline`` / ``pipelined_step``) with the aux loss on, PP2 x EP2 (4 ranks:
pp=2, dp_shard=2, ep=2), PP2 alone with activation checkpointing and PP2 interleaved, against one process training on the global batch
(``train_step``, one micro-batch per global pipeline micro-batch: each rank takes its part of
each, as the recipe's loader cuts them, and the data-parallel ranks balance it together) after a
few optimizer steps: the losses, every parameter, the aux loss and the tokens
per expert summed over the stages."""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

import hyper_parallel as hp
from hyper_parallel.trainer import compose_config, validate_config
from hyper_parallel.trainer.setup.parallelize import build_mesh, build_model
from hyper_parallel.trainer.setup.pipeline_parallel import build_pipeline, pipelined_step
from hyper_parallel.trainer.step.train_step import train_step
from tests.multirank import run_on_ranks

STEPS, SEED, LR, MAX_NORM = 3, 3, 1e-2, 1.0
GLOBAL_BATCH, SEQ, MICROBATCHES = 8, 16, 2
# 3 blocks: block 0 dense, blocks 1 and 2 MoE; stage 0 holds blocks 0-1, stage 1 block 2.
MODEL = ["model=moe_debug", "model.n_layers=3", "model.moe.first_k_dense=1", "model.ffn_hidden_dim=48",
         "model.moe.aux_loss_weight=0.1", f"training.seq_len={SEQ}", f"training.global_batch_size={GLOBAL_BATCH}",
         "training.max_grad_norm=1.0"]


def _batches() -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=gen) for _ in range(STEPS)]


def _full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, hp.DTensor) else param).detach().clone()


def _reference(micro_batches: int, model: List[str]) -> Dict[str, object]:
    """One process, the global batch as ``micro_batches`` accumulation steps; ``model``: overrides."""
    torch.set_default_dtype(torch.float64)
    try:
        cfg = validate_config(compose_config([*MODEL, *model]), 1).cfg.model
        model = build_model(cfg, mesh=None, device=torch.device("cpu"), seed=SEED)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        steps = [train_step(model, batch, opt, grad_accum_steps=micro_batches, max_grad_norm=MAX_NORM)
                 for batch in _batches()]
    finally:
        torch.set_default_dtype(torch.float32)
    return {"loss": [s["loss"].item() for s in steps], "aux": [s["aux_loss"].item() for s in steps],
            "tokens": [s["expert_tokens"] for s in steps],
            "params": {name: p.detach() for name, p in model.named_parameters()}}


def _pipelined(overrides: List[str]) -> Dict[str, object]:
    """This rank's view of PP training: its step results and its stages' full parameters."""
    torch.set_default_dtype(torch.float64)
    try:
        config = validate_config(compose_config([*MODEL, *overrides]), dist.get_world_size())
        dims = config.dims
        pipeline = build_pipeline(config.cfg.model, config.cfg.parallel, mesh=build_mesh(dims, "cpu"),
                                  device=torch.device("cpu"), seed=SEED, grad_accum_steps=1)
        opt = torch.optim.AdamW([p for part in pipeline.parts for p in part.parameters()], lr=LR)
        dp_rank, part = dims.dp_rank(dist.get_rank()), GLOBAL_BATCH // (dims.dp_size * MICROBATCHES)
        # This rank's part of each global micro-batch (DistributedBatchLoader(micro_batches=...)).
        steps = [pipelined_step(pipeline, torch.cat([micro[dp_rank * part:(dp_rank + 1) * part]
                                                     for micro in batch.chunk(MICROBATCHES)]),
                                opt, max_grad_norm=MAX_NORM)
                 for batch in _batches()]
    finally:
        torch.set_default_dtype(torch.float32)
    return {"last": pipeline.has_last, "loss": [s["loss"].item() for s in steps],
            "aux": [s["aux_loss"].item() for s in steps], "tokens": [s["expert_tokens"] for s in steps],
            "params": {name: _full(p) for part in pipeline.parts for name, p in part.named_parameters()}}


@pytest.mark.parametrize("ranks, overrides, model", [
    (4, ["parallel.pp=2", "parallel.ep=2"], []),  # pp=2 x dp_shard=2, the experts over ep=2 of each stage's 2 ranks
    # 2 stages per rank (blocks 0 | 1 on rank 0, 2 | 3 on rank 1): each stage reports its own
    # blocks; activation checkpointing: recomputed in the schedule's backward.
    (2, ["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B"],
     ["model.n_layers=4", "model.activation_checkpointing=true"]),
], ids=["pp2_ep2", "pp2_interleaved_checkpointed"])
def test_moe_pipeline_matches_one_process_on_the_global_batch(ranks, overrides, model):
    overrides = [*overrides, *model, f"parallel.pp_microbatches={MICROBATCHES}"]
    results = run_on_ranks(ranks, _pipelined, overrides, timeout=240)
    dp = ranks // 2
    ref = _reference(MICROBATCHES, model)
    moe_blocks = len(ref["tokens"][0])
    # The loss: the mean over the last stage's data-parallel ranks.
    losses = torch.tensor([r["loss"] for r in results if r["last"]], dtype=torch.float64).mean(dim=0)
    torch.testing.assert_close(losses, torch.tensor(ref["loss"], dtype=losses.dtype), rtol=1e-9, atol=0)
    # The aux loss and the tokens per expert: each stage reports its own blocks; summed over
    # every rank (as the recipe's step vote does) and averaged over the data-parallel ranks.
    aux = torch.tensor([r["aux"] for r in results], dtype=torch.float64).sum(dim=0) / dp
    assert min(ref["aux"]) > 0
    torch.testing.assert_close(aux, torch.tensor(ref["aux"], dtype=aux.dtype), rtol=1e-9, atol=0)
    for step in range(STEPS):
        tokens = sum(r["tokens"][step] for r in results)
        assert tokens.shape == (moe_blocks, 8) and int(tokens.sum()) == moe_blocks * GLOBAL_BATCH * SEQ * 2
        assert torch.equal(tokens, ref["tokens"][step]), step
    # Every parameter after the steps (each rank holds its stages' blocks).
    names = set()
    for result in results:
        for name, value in result["params"].items():
            torch.testing.assert_close(value, ref["params"][name], rtol=1e-9, atol=1e-12, msg=name)
            names.add(name)
    assert names == set(ref["params"])
