"""Pipeline parallelism (hyper_parallel.parallel.pipeline): the split, and parity of PP x FSDP / PP x TP
training with single-process training on the global batch, for each schedule."""

from typing import Optional

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.checkpoint import (CheckpointManager, ModelState, OptimizerState, StateDictOptions,
                                       get_optimizer_state_dict)
from hyper_parallel.core.fully_shard import collectives
from hyper_parallel.core.fully_shard.param_group import ShardState
from hyper_parallel.models import build_llama
from hyper_parallel.models.llama_parallel import apply_tensor_parallel, split_stage
from hyper_parallel.parallel.pipeline import (ShardedPipelineStage, build_schedule, stage_indices, stage_layers,
                                              stages_per_rank)
from hyper_parallel.parallel.tensor import cross_entropy, loss_parallel
from hyper_parallel.trainer.setup.parallelize import apply_activation_checkpointing
from tests.multirank import run_on_ranks

STEPS, LR, SEED, MAX_NORM = 3, 1e-2, 5, 0.5  # the gradient norms are ~0.73: clipping acts
GLOBAL_BATCH, SEQ, MICROBATCHES = 8, 16, 4


def _model(n_layers: int = 2, device: str = "cpu", **overrides):
    with torch.device(device):
        return build_llama("llama_debug", n_layers=n_layers, max_seq_len=SEQ, **overrides).double()


def _batches(steps: int):
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=gen) for _ in range(steps)]


def _full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if isinstance(param, hp.DTensor) else param).detach().clone()


def _reference(n_layers: int, steps: int = STEPS):
    """Single-process training on the global batch: per-step losses and gradient norms, and
    the final parameters."""
    model = _model(n_layers)
    model.init_weights(SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for tokens in _batches(steps):
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        norms.append(hp.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():  # evaluation on the next batch
        tokens = _batches(steps + 1)[-1]
        losses.append(cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).item())
    return losses, norms, {name: p.detach() for name, p in model.named_parameters()}


# -- unit checks -----------------------------------------------------------------------------

def test_stage_layers_split_and_errors():
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    assert stage_layers(6, 3, [1, 3, 2]) == [range(0, 1), range(1, 4), range(4, 6)]
    with pytest.raises(ValueError, match="3 pipeline stages need at least as many layers, the model has 2"):
        stage_layers(2, 3)
    for bad in ([2, 0, 4], [3, 2], [2, 2, 1]):
        with pytest.raises(ValueError, match=r"must be 3 integers >= 1 summing to the model's 6 layers"):
            stage_layers(6, 3, bad)
    assert [stages_per_rank(n) for n in ("1F1B", "GPipe", "Interleaved1F1B")] == [1, 1, 2]
    assert stage_indices(1, 2, "Interleaved1F1B") == [1, 3] and stage_indices(1, 2, "GPipe") == [1]
    with pytest.raises(ValueError, match="unknown pipeline schedule 'ZB'"):
        stages_per_rank("ZB")


def test_stage_keeps_names_and_full_model_values_and_runs_as_a_chain():
    full = _model(4)
    full.init_weights(SEED)
    with torch.device("meta"):
        meta = build_llama("llama_debug", n_layers=4, max_seq_len=SEQ)
    parts = []
    for index, layers in enumerate(stage_layers(4, 3)):
        part = split_stage(meta, layers, first=index == 0, last=index == 2)
        part.to_empty(device="cpu")
        part.double().init_weights(SEED)
        parts.append(part)
    assert len(meta.layers) == 4  # the model itself is left whole
    names = [list(dict(p.named_parameters())) for p in parts]
    assert names[1] == [f"layers.2.{n}" for n, _ in full.layers["2"].named_parameters()]
    assert names[0][0] == "tok_embeddings.weight" and names[2][-1] == "output.weight"
    expected = dict(full.named_parameters())
    for part in parts:
        for name, param in part.named_parameters():
            assert torch.equal(param, expected[name]), name
    tokens = torch.randint(0, 256, (2, SEQ))
    h = tokens
    for part in parts:
        h = part(h)
    torch.testing.assert_close(h, full(tokens), rtol=0, atol=0)


def test_split_refuses_tied_embeddings_and_bad_ranges():
    with torch.device("meta"):
        tied = build_llama("llama_debug", tie_embeddings=True)
    with pytest.raises(ValueError, match="tie_embeddings cannot be pipelined"):
        split_stage(tied, range(0, 1), first=True, last=False)
    split_stage(tied, range(0, 2), first=True, last=True)  # one stage: the whole model
    with pytest.raises(ValueError, match="not a non-empty range within the model's 2 layers"):
        split_stage(tied, range(1, 3), first=False, last=True)


# -- parity on 4 ranks -------------------------------------------------------------------------

# 4 ranks: pp=2 x the rest, as (pp, replicate, shard, tp)
_LAYOUTS = {"fsdp": (2, 1, 2, 1), "hsdp": (2, 2, 1, 1), "tp": (2, 1, 1, 2)}


def _pp_train(schedule: str, n_layers: int, layout: str, folder: Optional[str] = None, accum: int = 1,
              steps: int = STEPS):
    """pp=2 x (shard=2 | replicate=2 (HSDP) | tp=2) on 4 ranks; per rank: the last stage's step
    losses (or None) and evaluation loss, the gradient norms, the data-parallel rank, the
    gradient reductions per step and group, and the full values of this rank's stage parameters
    (and AdamW's ``exp_avg``) after ``steps`` optimizer steps; with ``folder``, a checkpoint of
    the stages saved there. ``accum``: schedule steps per optimizer step (each on a slice of the
    batch, MICROBATCHES / accum microbatches)."""
    mesh = hp.init_device_mesh("cpu", _LAYOUTS[layout], mesh_dim_names=("pp", "replicate", "shard", "tp"))
    dp = mesh["replicate", "shard"] if layout == "hsdp" else mesh["shard"]
    pp_rank, pp_group = mesh["pp"].get_local_rank(), mesh["pp"].get_group()
    with torch.device("meta"):
        meta = build_llama("llama_debug", n_layers=n_layers, max_seq_len=SEQ)
    ranges = stage_layers(n_layers, 2 * stages_per_rank(schedule))
    parts, stages = [], []
    for index in stage_indices(pp_rank, 2, schedule):
        part = split_stage(meta, ranges[index], first=index == 0, last=index == len(ranges) - 1)
        if layout == "tp":
            apply_tensor_parallel(part, mesh["tp"])
        if schedule == "1F1B":  # recomputation inside the schedule's backward
            apply_activation_checkpointing(part)
        for block in part.layers.values():
            hp.fully_shard(block, mesh=dp)
        hp.fully_shard(part, mesh=dp)
        part.to_empty(device="cpu")
        part.double().init_weights(SEED)
        parts.append(part)
        stages.append(ShardedPipelineStage(part, index, len(ranges), torch.device("cpu"), group=pp_group,
                                           mesh=mesh))
    sched = build_schedule(stages, schedule, MICROBATCHES // accum, cross_entropy, grad_accum=accum)
    reductions = []
    groups = [m for part in parts for m in part.modules() if isinstance(m, hp.FSDPModule)
              and m._hsdp_state.group.params]  # (an interleaved middle stage's root holds none)
    for module in groups:
        module.set_all_reduce_hook(lambda grad: reductions.append(1))
    params = [p for part in parts for p in part.parameters()]
    opt = torch.optim.AdamW(params, lr=LR)
    dp_size = mesh["replicate"].size() * mesh["shard"].size()
    dp_rank = mesh["replicate"].get_local_rank() * mesh["shard"].size() + mesh["shard"].get_local_rank()
    local = GLOBAL_BATCH // dp_size
    is_last = any(s.is_last for s in stages)
    step_losses, norms = [], []
    for tokens in _batches(steps):
        step_loss = 0.0
        for chunk in tokens[dp_rank * local:(dp_rank + 1) * local].chunk(accum):
            losses = []  # (step() refills it)
            with loss_parallel():
                if stages[0].is_first:
                    sched.step(chunk[:, :-1], target=chunk[:, 1:] if is_last else None, losses=losses)
                else:
                    sched.step(target=chunk[:, 1:] if is_last else None, losses=losses)
            step_loss += sum(loss.item() for loss in losses)
        norms.append(hp.clip_grad_norm_(params, MAX_NORM, pp_group=pp_group).item())
        assert all(m._hsdp_state.group.state is ShardState.SHARDED for m in groups), "a stage stayed unsharded"
        opt.step()
        opt.zero_grad()
        if is_last:
            step_losses.append(step_loss)
    reductions = len(reductions) / (steps * accum * len(groups))
    # Evaluation (forward only) on the next batch, after training: the loss of the final model.
    tokens = _batches(steps + 1)[-1][dp_rank * local:(dp_rank + 1) * local]
    losses = []
    with loss_parallel(), torch.no_grad():
        sched.eval(*((tokens[:, :-1],) if stages[0].is_first else ()), target=tokens[:, 1:] if is_last else None,
                   losses=losses)
    assert all(m._hsdp_state.group.state is ShardState.SHARDED for m in groups)
    if is_last:
        step_losses.append(sum(l.item() for l in losses))
    full = {name: _full(p) for part in parts for name, p in part.named_parameters()}
    full_optim = get_optimizer_state_dict(parts, opt, options=StateDictOptions(full_state_dict=True))
    exp_avg = {name: state["exp_avg"] for name, state in full_optim["state"].items()}
    if folder is not None:
        CheckpointManager(folder).save(steps, {"model": ModelState(parts),
                                               "optim": OptimizerState(parts, opt, pp_group=pp_group)})
    return (step_losses if is_last else None), norms, dp_rank, reductions, {"params": full, "exp_avg": exp_avg}


def _pp_resume(folder: str, n_layers: int):
    """Load the checkpoint in ``folder`` into pp=2 x shard=2 stages of another split (1F1B: one
    stage of n_layers / 2 blocks per rank); the full values of this rank's parameters and
    ``exp_avg``, and its optimizer's learning rate."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "shard"))
    pp_rank = mesh["pp"].get_local_rank()
    with torch.device("meta"):
        meta = build_llama("llama_debug", n_layers=n_layers, max_seq_len=SEQ)
    ranges = stage_layers(n_layers, 2)
    part = split_stage(meta, ranges[pp_rank], first=pp_rank == 0, last=pp_rank == 1)
    hp.fully_shard(part, mesh=mesh["shard"])
    part.to_empty(device="cpu")
    part.double().init_weights(SEED + 1)
    opt = torch.optim.AdamW(part.parameters(), lr=LR / 2)
    state = {"model": ModelState([part]), "optim": OptimizerState([part], opt, pp_group=mesh["pp"].get_group())}
    CheckpointManager(folder).load_latest(state)
    full_optim = get_optimizer_state_dict(part, opt, options=StateDictOptions(full_state_dict=True))
    return ({name: _full(p) for name, p in part.named_parameters()},
            {name: s["exp_avg"] for name, s in full_optim["state"].items()}, opt.param_groups[0]["lr"])


def _pp_collectives_per_step(schedule: str):
    """pp=2 x shard=2, blocks with reshard_after_forward=False: the all-gathers and
    reduce-scatters of this rank's second step, and its number of parameter groups."""
    mesh = hp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "shard"))
    pp_rank = mesh["pp"].get_local_rank()
    with torch.device("meta"):
        meta = build_llama("llama_debug", n_layers=2, max_seq_len=SEQ)
    part = split_stage(meta, range(pp_rank, pp_rank + 1), first=pp_rank == 0, last=pp_rank == 1)
    hp.fully_shard(part.layers[str(pp_rank)], mesh=mesh["shard"], reshard_after_forward=False)
    hp.fully_shard(part, mesh=mesh["shard"])
    part.to_empty(device="cpu")
    part.init_weights(SEED)
    stage = ShardedPipelineStage(part, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    sched = build_schedule([stage], schedule, MICROBATCHES, cross_entropy)
    tokens = _batches(1)[0][:GLOBAL_BATCH // 2]
    for _ in range(2):
        collectives.reset_collective_counts()
        sched.step(*((tokens[:, :-1],) if pp_rank == 0 else ()), target=tokens[:, 1:] if pp_rank == 1 else None)
    return collectives.collective_counts(), 2


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_stage_gathers_and_reduces_each_group_once_per_step(schedule):
    """Parameters stay unsharded from the first microbatch's forward to the last backward, and
    gradients are reduce-scattered once (the stage of torch's FSDP2 integration)."""
    for counts, groups in run_on_ranks(4, _pp_collectives_per_step, schedule, timeout=120):
        assert counts.get("all_gather") == groups and counts.get("reduce_scatter") == groups, counts


def _split_backward_is_refused():
    rank = torch.distributed.get_rank()
    with torch.device("meta"):
        part = split_stage(build_llama("llama_debug"), range(rank, rank + 1), first=rank == 0, last=rank == 1)
    hp.fully_shard(part, mesh=hp.init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "shard"))["shard"])
    stage = ShardedPipelineStage(part, rank, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="ShardedPipelineStage runs full backwards only .* not a split 'input'"):
        stage.backward_maybe_with_nosync("input", {})


def test_split_backward_schedules_are_refused_in_one_line():
    run_on_ranks(2, _split_backward_is_refused, timeout=60)


def _assert_matches_reference(results, n_layers):
    ref_losses, ref_norms, ref_params = _reference(n_layers)
    by_dp = {}
    seen = {}
    for losses, norms, dp_rank, reductions, full in results:
        if losses is not None:
            by_dp[dp_rank] = losses
        seen.update(full["params"])
        assert norms == pytest.approx(ref_norms, rel=1e-10)  # over all stages: clip_grad_norm_'s pp_group
        assert reductions == 1  # once per step (the last microbatch's backward), not per microbatch
    # dp ranks see different halves: their mean is the global-batch loss
    mean = [sum(v[i] for v in by_dp.values()) / len(by_dp) for i in range(STEPS + 1)]
    assert mean == pytest.approx(ref_losses, rel=1e-10)
    assert seen.keys() == ref_params.keys()
    for name, value in ref_params.items():
        torch.testing.assert_close(seen[name], value, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("schedule,n_layers,layout", [("1F1B", 2, "fsdp"), ("GPipe", 2, "fsdp"),
                                                     ("Interleaved1F1B", 4, "fsdp"), ("1F1B", 2, "hsdp")])
def test_pp2_fsdp2_matches_single_process_training(schedule, n_layers, layout, tmp_path):
    """PP2 x FSDP2 (and x HSDP 2x1) matches single-process training on the global batch, also
    with gradient accumulation over two schedule steps (GPipe); interleaved (two stages per
    rank): the checkpoint of the stages, each rank saving only its own keys, loads bit-exactly
    into one plain model and optimizer."""
    folder = str(tmp_path) if schedule == "Interleaved1F1B" else None
    accum = 2 if schedule == "GPipe" else 1  # two schedule steps per optimizer step (gradient accumulation)
    results = run_on_ranks(4, _pp_train, schedule, n_layers, layout, folder, accum, timeout=180)
    _assert_matches_reference(results, n_layers)
    if folder is None:
        return
    model = _model(n_layers)
    optim = torch.optim.AdamW(model.parameters(), lr=LR / 2)
    state = {"model": ModelState(model), "optim": OptimizerState(model, optim)}
    assert CheckpointManager(folder).load_latest(state) == STEPS and optim.param_groups[0]["lr"] == LR
    saved = {kind: {k: v for result in results for k, v in result[-1][kind].items()} for kind in ("params", "exp_avg")}
    assert saved["params"].keys() == dict(model.named_parameters()).keys()
    for name, param in model.named_parameters():
        assert torch.equal(param, saved["params"][name]), name
        assert torch.equal(optim.state[param]["exp_avg"], saved["exp_avg"][name]), name
    # ... and into pipeline stages of another split (resuming with another schedule)
    for params, exp_avg, lr in run_on_ranks(4, _pp_resume, folder, n_layers, timeout=120):
        assert lr == LR and params.keys() == exp_avg.keys()
        assert all(torch.equal(v, saved["params"][k]) and torch.equal(exp_avg[k], saved["exp_avg"][k])
                   for k, v in params.items())


@pytest.mark.parametrize("schedule,n_layers", [  # GPipe, and Interleaved1F1B by default: with FSDP above
    ("1F1B", 2), pytest.param("Interleaved1F1B", 4, marks=pytest.mark.slow)])
def test_pp2_tp2_matches_single_process_training(schedule, n_layers):
    results = run_on_ranks(4, _pp_train, schedule, n_layers, "tp", timeout=180)
    _assert_matches_reference(results, n_layers)
