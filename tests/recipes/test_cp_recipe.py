"""Context parallelism (``parallel.cp``) in the recipe: a CP run trains, evaluates and
checkpoints exactly like a run without CP on the same global batches, also with tensor or
pipeline parallelism, and a CP checkpoint resumes on CP x TP and PP x CP layouts.

The runs are in float64 (the default dtype set on each rank before the model is built; see
tests/fully_shard/_helpers.py, [Note: parity in float64]): CP sums the attention and the loss
in another order than one process, which is ~1e-16 relative noise that a few AdamW steps keep
far below the tolerance; a defect (a lost block, a wrong position, a wrong gradient average or
data order) moves the loss by 1e-4 or more.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Set, Tuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.models import attention
from hyper_parallel.parallel.context import current_context
from hyper_parallel.parallel.ring_attention import cp_attention
from hyper_parallel.platform import get_platform
from hyper_parallel.trainer import ConfigError, compose_config, run_training, validate_config
from hyper_parallel.trainer.launch.reporting import layout
from tests.multirank import run_on_ranks
from tests.recipes.launch import TINY, last_loss_per_step, read_metrics
from tests.recipes.train_in_process import one_line_error

REL = 1e-9
CP2 = ["parallel.cp=2"]
STEPS = ["training.steps=4", "training.seq_len=16", "eval.every=2", "eval.steps=1", "checkpoint.interval=2"]


def _train_float64(overrides: List[str]) -> None:
    """The recipe in float64; also writes what the model's attention saw on this rank (see
    :func:`_attention_calls`)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    seen: Set[Tuple[int, int, int, int]] = set()

    def recording(q, k, v, **kwargs):
        context = current_context()
        seen.add((q.shape[1], k.shape[1], q.shape[2], context.size if context is not None else 1))
        return cp_attention(q, k, v, **kwargs)

    try:
        cfg = compose_config([*TINY, *STEPS, *overrides])
        with mock.patch.object(attention, "cp_attention", recording):
            run_training(validate_config(cfg, dist.get_world_size()), get_platform())
    finally:
        torch.set_default_dtype(default)
    with open(os.path.join(cfg.output_dir, f"attention-{dist.get_rank()}.json"), "w") as f:
        json.dump(sorted(seen), f)


def _attention_calls(output_dir, world: int) -> List[List[List[int]]]:
    """Per rank, the distinct (query heads, key/value heads, local sequence length, CP size)
    its attention calls saw."""
    return [json.loads((output_dir / f"attention-{rank}.json").read_text()) for rank in range(world)]


def _curves(output_dir: str) -> Dict[str, Dict[int, float]]:
    records = read_metrics(output_dir)
    return {"loss": last_loss_per_step(output_dir),
            "val_loss": {r["step"]: r["val_loss"] for r in records if "val_loss" in r},
            "grad_norm": {r["step"]: r["grad_norm"] for r in records if "grad_norm" in r}}


def _assert_close(expected: Dict[int, float], actual: Dict[int, float]) -> None:
    assert sorted(actual) == sorted(expected) and expected, (expected, actual)
    for step, value in expected.items():
        assert abs(actual[step] - value) <= REL * abs(value), (step, value, actual[step])


# name: (world size, overrides)
RUNS = {"cp1": (1, []), "dp2_loss_chunks4": (2, ["training.loss_chunks=4"]), "cp2": (2, CP2),
        "hsdp2_cp2_allgather_ac_accum_loss_chunks3": (4, [*CP2, "parallel.dp_replicate=2", "parallel.cp_rotate=allgather",
                                                          "model.activation_checkpointing=true",
                                                          "training.grad_accum_steps=2", "training.loss_chunks=3"]),
        "cp2_tp2": (4, [*CP2, "parallel.tp=2"]), "pp2_cp2": (4, [*CP2, "parallel.pp=2"]),
        "cp4": (4, ["parallel.cp=4"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The output folders of the :data:`RUNS`, each trained for 4 steps (checkpoints at 2 and 4)."""
    root = tmp_path_factory.mktemp("cp_runs")
    for name, (world, overrides) in RUNS.items():
        run_on_ranks(world, _train_float64, [f"output_dir={root / name}", *overrides], timeout=180)
    return root


def test_cp2_trains_and_evaluates_like_cp1_and_dp2(runs):
    """The same losses, gradient norms and validation losses at every step, whatever the CP
    degree and rotation, also with HSDP over two data-parallel ranks x CP2, activation
    checkpointing and gradient accumulation, and with the loss in chunks (training.loss_chunks,
    training and evaluation; 3 does not divide a CP rank's 8 tokens)."""
    curves = {name: _curves(str(runs / name)) for name in RUNS}
    expected = curves["cp1"]
    assert len(expected["loss"]) == 4 and sorted(expected["val_loss"]) == [2, 4], expected
    for name in ("dp2_loss_chunks4", "cp2", "hsdp2_cp2_allgather_ac_accum_loss_chunks3", "cp4"):
        for key in expected:
            _assert_close(expected[key], curves[name][key])
    assert '"mesh": {"shard": 1, "cp": 2}' in (runs / "cp2" / "metrics.jsonl").read_text()


@pytest.mark.parametrize("name, mesh", [("cp2_tp2", '{"shard": 1, "cp": 2, "tp": 2}'),
                                        ("pp2_cp2", '{"pp": 2, "shard": 1, "cp": 2}')])
def test_cp_with_tensor_or_pipeline_parallelism_trains_like_one_process(runs, name, mesh):
    """CP2 x TP2 (ring attention on each tp rank's heads, sequence-parallel norms on the CP part,
    the loss over vocab-parallel logits) and PP2 x CP2 (each pipeline micro-batch the CP part
    of its sequences) train, clip and evaluate as one process on the global batches."""
    expected, actual = _curves(str(runs / "cp1")), _curves(str(runs / name))
    for key in expected:
        _assert_close(expected[key], actual[key])
    assert f'"mesh": {mesh}' in (runs / name / "metrics.jsonl").read_text()
    # Ring attention over 2 CP ranks on 8 of the 16 tokens, with TP on 2 of the 4 query heads
    # and 1 of the 2 key/value heads.
    heads = [2, 1] if name == "cp2_tp2" else [4, 2]
    assert _attention_calls(runs / name, 4) == [[[*heads, 8, 2]]] * 4
    assert _attention_calls(runs / "cp1", 1) == [[[4, 2, 16, 1]]]


def test_startup_line_names_the_mesh_with_cp_also_with_tp_or_pp():
    config = validate_config(compose_config([*TINY, *CP2, "parallel.dp_shard=2"]), 4)
    assert layout(config.cfg, config.dims) == "mesh 2x2 (shard, cp), context parallel over 2 ranks (ring), fp32"
    assert config.dims.mesh_shape == {"shard": 2, "cp": 2} and config.dims.loss_ranks == 4
    # The CP ranks of one data-parallel index read the same samples.
    assert [config.dims.dp_rank(rank) for rank in range(4)] == [0, 0, 1, 1]
    with_tp = validate_config(compose_config([*TINY, *CP2, "parallel.tp=2"]), 4)
    assert layout(with_tp.cfg, with_tp.dims) == "mesh 1x2x2 (shard, cp, tp), context parallel over 2 ranks (ring), fp32"
    assert [with_tp.dims.dp_rank(rank) for rank in range(4)] == [0, 0, 0, 0] and with_tp.dims.loss_ranks == 4
    with_pp = validate_config(compose_config([*TINY, *CP2, "parallel.pp=2"]), 4)
    assert layout(with_pp.cfg, with_pp.dims) == ("mesh 2x1x2 (pp, shard, cp), pipeline 1F1B with 4 micro-batches, "
                                                 "context parallel over 2 ranks (ring), fp32")
    assert [with_pp.dims.pp_rank(rank) for rank in range(4)] == [0, 0, 1, 1] and with_pp.dims.loss_ranks == 2


@pytest.mark.parametrize("world, overrides, expected", [
    (2, ["training.seq_len=18"], "training.seq_len=18 is not divisible by 2 x parallel.cp=2 = 4 (each sequence"),
    (8, ["parallel.tp=4", "model.n_kv_heads=4", "training.seq_len=12"],
     "training.seq_len=12 / parallel.cp=2 = 6 tokens per CP rank is not divisible by parallel.tp=4"),
    (2, ["parallel.cp=3", "training.seq_len=60"], "parallel.cp=3 does not divide the world size 2"),
    (2, ["parallel.cp_rotate=zigzag"], "parallel.cp_rotate"),
    (2, ["parallel.cp=1", "parallel.cp_rotate=allgather"], "parallel.cp_rotate=allgather needs parallel.cp > 1"),
    (2, ["training.seq_len=16", "training.loss_chunks=9"], "training.loss_chunks=9 exceeds the 8 tokens of each"),
])
def test_impossible_cp_settings_are_refused_in_one_line(check, monkeypatch, world, overrides, expected):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(world))
    one_line_error(*check(*CP2, *overrides)[::2], expected)


def test_a_model_without_the_projects_attention_is_refused():
    from hyper_parallel.models.llama import Transformer
    from hyper_parallel.trainer.config import llama_config
    from hyper_parallel.trainer.setup.context_parallel import use_ring_attention

    with torch.device("meta"):
        model = Transformer(llama_config(compose_config(TINY).model))
    use_ring_attention(model)
    model.layers["1"].attention = torch.nn.MultiheadAttention(32, 4)
    with pytest.raises(ConfigError, match=r"parallel.cp needs the project's attention .* block 1 "
                                          r"\(TransformerBlock\) has none"):
        use_ring_attention(model)


def _assert_resumes_on_the_cp1_curve(runs, tmp_path, world: int, checkpoint: str, overrides: List[str]) -> str:
    """Resume ``checkpoint`` (a step-2 checkpoint of one of the runs) on ``world`` ranks with
    ``overrides``: steps 3 and 4 and the step-4 validation loss are CP1's. Returns the metrics."""
    run_on_ranks(world, _train_float64, [f"output_dir={tmp_path}", f"checkpoint.load_from={checkpoint}", *overrides],
                 timeout=180)
    resumed, expected = _curves(str(tmp_path)), _curves(str(runs / "cp1"))
    _assert_close({step: expected["loss"][step] for step in (3, 4)}, resumed["loss"])
    _assert_close({4: expected["val_loss"][4]}, resumed["val_loss"])
    return (tmp_path / "metrics.jsonl").read_text()


@pytest.mark.parametrize("source, world", [("cp4", 1), ("cp2", 2)], ids=["cp4_to_cp1", "cp2_to_dp2"])
def test_a_cp_checkpoint_resumes_without_cp_on_the_uninterrupted_curve(runs, tmp_path, source, world):
    """A CP4 (CP2) run's step-2 checkpoint, resumed on one rank (on two data-parallel ranks),
    continues the uninterrupted losses (data order, optimizer state and schedule included)."""
    _assert_resumes_on_the_cp1_curve(runs, tmp_path, world, f"{runs}/{source}/checkpoints/step-2", [])


@pytest.mark.parametrize("overrides, mesh", [([*CP2, "parallel.tp=2"], '{"shard": 1, "cp": 2, "tp": 2}'),
                                             ([*CP2, "parallel.pp=2"], '{"pp": 2, "shard": 1, "cp": 2}')],
                         ids=["cp2_tp2", "pp2_cp2"])
def test_a_cp4_checkpoint_resumes_on_cp_x_tp_and_pp_x_cp_on_the_uninterrupted_curve(runs, tmp_path, overrides, mesh):
    """CP4's step-2 checkpoint, resumed on CP2 x TP2 or PP2 x CP2 (4 ranks each), continues the
    uninterrupted losses."""
    metrics = _assert_resumes_on_the_cp1_curve(runs, tmp_path, 4, f"{runs}/cp4/checkpoints/step-2", overrides)
    assert f'"mesh": {mesh}' in metrics


def test_every_command_of_the_long_context_docs_validates_on_its_ranks():
    """docs/recipes.md's long-context commands (the 128k one included) pass the pre-start check
    on the number of ranks they name."""
    import re
    import shlex

    from tests.recipes.launch import REPO

    with open(os.path.join(REPO, "docs", "recipes.md")) as f:
        section = f.read().split("## Long context (context parallelism)", 1)[1].split("\n## ", 1)[0]
    commands = [line for block in re.findall(r"```bash\n(.*?)```", section, re.S)
                for line in block.replace("\\\n", " ").strip().splitlines()]
    assert len(commands) >= 5, commands
    for command in commands:
        words = shlex.split(command, comments=True)
        ranks = int(next(w for w in words if w.startswith("--nproc_per_node=")).split("=")[1])
        config = validate_config(compose_config(words[words.index("recipes/train.py") + 1:]), ranks)
        assert config.dims.cp > 1, command
