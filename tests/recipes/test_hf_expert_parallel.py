"""``parallel.ep`` with ``model=hf``: transformers' own Qwen3-MoE (its load-balancing loss on)
and DeepSeek-V3 (a dense layer, a shared expert; activations checkpointed) split their grouped
3-D experts over 2 ranks (``dp_shard=2 ep=2``), the tokens sent by all-to-all, and train the
one-process losses; the experts are stored as ``Shard(0)`` in 2 chunks under transformers'
names, and a 2-rank EP checkpoint resumes on one process on the uninterrupted curve; models
whose experts cannot be split are refused in one line by ``--check``."""

from __future__ import annotations

import json
from typing import List
from unittest import mock

import pytest
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from hyper_parallel.checkpoint import read_checkpoint_metadata  # noqa: E402
from hyper_parallel.models import hf_expert_parallel  # noqa: E402
from hyper_parallel.platform import get_platform  # noqa: E402
from hyper_parallel.trainer import compose_config, run_training, validate_config  # noqa: E402
from tests.multirank import run_on_ranks  # noqa: E402
from tests.recipes.launch import assert_losses_match, last_loss_per_step  # noqa: E402
from tests.recipes.test_hf_model import RUN, SHAPE, _write_folder  # noqa: E402
from tests.recipes.train_in_process import one_line_error  # noqa: E402

EP = ["parallel.ep=2", "parallel.dp_shard=2"]
LAYOUTS = {"qwen3_moe": [], "deepseek_v3": ["model.activation_checkpointing=true", "checkpoint.interval=3"]}
RESUMED = "qwen3_moe"
# 2 MoE layers; 1 MoE layer (the first is dense), its forward run twice (activation checkpointing).
DISPATCHES_PER_STEP = {"qwen3_moe": 2, "deepseek_v3": 2}
# transformers' load-balancing loss is each forward's (each rank's on 2 ranks): one process
# computes it per micro-batch, the rows of one rank (the global micro-batches: the same rows).
ONE_PROCESS = {"qwen3_moe": ["training.grad_accum_steps=2"], "deepseek_v3": []}


def _with_router_loss(folder: str) -> None:
    """Qwen3-MoE's load-balancing loss on, weighted so that its gradients count."""
    config = json.loads(open(f"{folder}/config.json").read())
    with open(f"{folder}/config.json", "w") as f:
        json.dump({**config, "output_router_logits": True, "router_aux_loss_coef": 0.5}, f)


def _train(runs: List[List[str]]) -> List[int]:
    """Each run's training on this rank; how many tokens dispatches each made (all-to-all pairs)."""
    dispatches = []
    for overrides in runs:
        with mock.patch.object(hf_expert_parallel, "dispatch_tokens",
                               wraps=hf_expert_parallel.dispatch_tokens) as dispatch:
            run_training(validate_config(compose_config([*RUN, *overrides]), dist.get_world_size()), get_platform())
        dispatches.append(dispatch.call_count)
    return dispatches


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Each family's folder, its EP2 run, its one-process run, and Qwen3-MoE resumed on one
    process from its EP2 checkpoint of step 2."""
    root = tmp_path_factory.mktemp("hfep")
    paths = {family: _write_folder(root / family, family) for family in LAYOUTS}
    _with_router_loss(paths["qwen3_moe"])
    out = {family: {kind: str(root / f"{family}-{kind}") for kind in ("ep", "one", "resumed")} for family in paths}
    dispatches = run_on_ranks(2, _train, [[f"model.path={paths[f]}", f"output_dir={out[f]['ep']}", *EP, *LAYOUTS[f]]
                                          for f in paths], timeout=300)
    run_on_ranks(1, _train, [[f"model.path={paths[f]}", f"output_dir={out[f]['one']}", "checkpoint.interval=3",
                              *ONE_PROCESS[f]] for f in paths]
                 + [[f"model.path={paths[RESUMED]}", f"output_dir={out[RESUMED]['resumed']}",
                     f"checkpoint.load_from={out[RESUMED]['ep']}/checkpoints/step-2"]], timeout=300)
    return out, dispatches


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_expert_parallel_trains_the_one_process_losses(trained, family):
    out, dispatches = trained
    one, ep = last_loss_per_step(out[family]["one"]), last_loss_per_step(out[family]["ep"])
    assert sorted(one) == sorted(ep) == [1, 2, 3] and one[3] < one[1]
    assert_losses_match(one, ep, rel=1e-5)
    stored = read_checkpoint_metadata(f"{out[family]['ep']}/checkpoints/step-3").state_dict_metadata
    for weight, size in (("gate_up_proj", (4, 32, 32)), ("down_proj", (4, 32, 16))):
        md = stored[f"model.model.layers.1.mlp.experts.{weight}"]
        offsets = sorted(tuple(md.chunks.offsets_of(i)) for i in range(len(md.chunks)))
        assert tuple(md.size) == size and offsets == [(0, 0, 0), (2, 0, 0)]  # Shard(0): 2 experts a rank
    # Every rank sent its tokens to the experts' ranks: per MoE layer and step, one dispatch in
    # the forward (and one more in the recomputation of checkpointed activations).
    assert _dispatches(dispatches, family) == [3 * DISPATCHES_PER_STEP[family]] * 2


def _dispatches(dispatches: List[List[int]], family: str) -> List[int]:
    """Each rank's token dispatches in ``family``'s EP run."""
    return [per_rank[list(LAYOUTS).index(family)] for per_rank in dispatches]


def test_an_expert_parallel_checkpoint_resumes_on_one_process(trained):
    out, dispatches = trained
    assert _dispatches(dispatches, RESUMED) == [3 * DISPATCHES_PER_STEP[RESUMED]] * 2  # the checkpoint is EP's
    one, resumed = last_loss_per_step(out[RESUMED]["one"]), last_loss_per_step(out[RESUMED]["resumed"])
    assert sorted(resumed) == [3]
    assert_losses_match(one, resumed, range(3, 4), rel=1e-5)


def _folder(folder, case: str) -> str:
    if case == "not_divisible":  # Qwen3-MoE with 3 experts a layer
        transformers.Qwen3MoeConfig(**SHAPE, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8,
                                    num_experts=3).save_pretrained(folder)
    elif case == "no_gate":  # Nemotron-H: grouped experts without a gate (up -> act -> down)
        transformers.NemotronHConfig(**SHAPE, n_routed_experts=4, num_experts_per_tok=2).save_pretrained(folder)
    elif case == "not_interface":  # JetMoE: its own experts, outside transformers' experts interface
        transformers.JetMoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_local_experts=4, kv_channels=8,
                                  num_key_value_heads=2, num_experts_per_tok=2).save_pretrained(folder)
    else:
        return _write_folder(folder, case, weights=False)
    return str(folder)


@pytest.mark.parametrize("case, expected", [
    ("llama", "parallel.ep=2: LlamaForCausalLM has no experts (a dense model); set parallel.ep=1"),
    ("not_divisible", "parallel.ep=2 does not divide Qwen3MoeForCausalLM's 3 experts per layer"),
    ("no_gate", "parallel.ep=2: NemotronHForCausalLM's experts model.layers.1.mixer.experts (NemotronHExperts: "
                "has_gate=False) are not grouped gate_up_proj [E, 2I, H] / down_proj [E, H, I] experts"),
    ("not_interface", "parallel.ep=2: JetMoeForCausalLM's experts do not run through transformers' experts "
                      "interface"),
])
def test_experts_that_cannot_be_split_are_refused_in_one_line(tmp_path, check, case, expected):
    folder = _folder(tmp_path / "dir", case)
    one_line_error(*check("model=hf", f"model.path={folder}", *EP)[::2], expected)
