"""``parallel.ep`` with ``model=hf``: transformers' own Qwen3-MoE (its load-balancing loss on)
and DeepSeek-V3 (a dense layer, a shared expert; activations checkpointed; and with CP2) split
their grouped 3-D experts over 2 ranks (``dp_shard=2 ep=2``), the tokens sent by all-to-all,
and train the one-process losses; each rank reads only its experts from the folder's
per-expert tensors; the experts are stored as ``Shard(0)`` in 2 chunks under transformers'
names, and a 2-rank EP checkpoint resumes on one process on the uninterrupted curve; models
whose experts cannot be split are refused in one line by ``--check``."""

from __future__ import annotations

import json
from typing import List, Tuple
from unittest import mock

import pytest
import torch
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
# The 2-rank runs: name -> (family, overrides, token dispatches per step: MoE layers x forwards).
EP_RUNS = {
    "qwen3_moe": ("qwen3_moe", EP, 2),  # 2 MoE layers
    # 1 MoE layer (the first is dense), its forward run twice (activation checkpointing)
    "deepseek_v3": ("deepseek_v3", [*EP, "model.activation_checkpointing=true", "checkpoint.interval=3"], 2),
    # the experts over the dp_shard x cp ranks (ring attention)
    "deepseek_v3_cp2": ("deepseek_v3", ["parallel.ep=2", "parallel.dp_shard=1", "parallel.cp=2",
                                        "checkpoint.interval=3"], 1),
}
FAMILIES = ("qwen3_moe", "deepseek_v3")
RESUMED = "qwen3_moe"
# transformers' load-balancing loss is each forward's (each rank's on 2 ranks): one process
# computes it per micro-batch, the rows of one rank (the global micro-batches: the same rows).
ONE_PROCESS = {"qwen3_moe": ["training.grad_accum_steps=2"], "deepseek_v3": []}


def _with_router_loss(folder: str) -> None:
    """Qwen3-MoE's load-balancing loss on, weighted so that its gradients count."""
    config = json.loads(open(f"{folder}/config.json").read())
    with open(f"{folder}/config.json", "w") as f:
        json.dump({**config, "output_router_logits": True, "router_aux_loss_coef": 0.5}, f)


def _train(runs: List[List[str]]) -> List[int]:
    """Each run's training on this rank; how many token dispatches each made (all-to-all pairs)."""
    dispatches = []
    for overrides in runs:
        with mock.patch.object(hf_expert_parallel, "dispatch_tokens",
                               wraps=hf_expert_parallel.dispatch_tokens) as dispatch:
            run_training(validate_config(compose_config([*RUN, *overrides]), dist.get_world_size()), get_platform())
        dispatches.append(dispatch.call_count)
    return dispatches


def _expert_reads(path: str) -> List[Tuple[str, int]]:
    """The (weight, expert) chunks of layer 1's experts this rank reads from ``path`` when the
    recipe builds the EP2 model (each expert's gate and up rows once each)."""
    from hyper_parallel.core.distributed_checkpoint.filesystem.reader import FileSystemReader
    from hyper_parallel.trainer.setup.parallelize import build_mesh, build_model

    reads, execute_read = [], FileSystemReader.execute_read

    def recording(self, plan, planner):
        reads.extend((item.storage_index.fqn.rsplit(".", 1)[-1], item.storage_index.offset[0])
                     for item in plan.items if item.storage_index.fqn.startswith("model.layers.1.mlp.experts."))
        return execute_read(self, plan, planner)

    config = validate_config(compose_config([*RUN, f"model.path={path}", *EP]), dist.get_world_size())
    with mock.patch.object(FileSystemReader, "execute_read", recording):
        build_model(config.cfg.model, mesh=build_mesh(config.dims, "cpu"), device=torch.device("cpu"), seed=0,
                    ep=2, meta_model=config.meta_model)
    return sorted(reads)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The EP runs on 2 ranks, each family's one-process run, Qwen3-MoE resumed on one process
    from its EP2 checkpoint of step 2, and the experts each rank read."""
    root = tmp_path_factory.mktemp("hfep")
    paths = {family: _write_folder(root / family, family) for family in FAMILIES}
    _with_router_loss(paths["qwen3_moe"])
    out = {name: str(root / name) for name in (*EP_RUNS, *(f"{f}-one" for f in FAMILIES), "resumed")}
    dispatches = run_on_ranks(2, _train, [[f"model.path={paths[family]}", f"output_dir={out[name]}", *overrides]
                                          for name, (family, overrides, _) in EP_RUNS.items()], timeout=300)
    reads = run_on_ranks(2, _expert_reads, paths["qwen3_moe"], timeout=120)
    run_on_ranks(1, _train, [[f"model.path={paths[f]}", f"output_dir={out[f + '-one']}", "checkpoint.interval=3",
                              *ONE_PROCESS[f]] for f in FAMILIES]
                 + [[f"model.path={paths[RESUMED]}", f"output_dir={out['resumed']}",
                     f"checkpoint.load_from={out[RESUMED]}/checkpoints/step-2"]], timeout=300)
    return out, {name: [per_rank[i] for per_rank in dispatches] for i, name in enumerate(EP_RUNS)}, reads


@pytest.mark.parametrize("name", list(EP_RUNS))
def test_expert_parallel_trains_the_one_process_losses(trained, name):
    out, dispatches, _ = trained
    family, _, per_step = EP_RUNS[name]
    one, ep = last_loss_per_step(out[f"{family}-one"]), last_loss_per_step(out[name])
    assert sorted(one) == sorted(ep) == [1, 2, 3] and one[3] < one[1]
    assert_losses_match(one, ep, rel=1e-5)
    stored = read_checkpoint_metadata(f"{out[name]}/checkpoints/step-3").state_dict_metadata
    for weight, size in (("gate_up_proj", (4, 32, 32)), ("down_proj", (4, 32, 16))):
        md = stored[f"model.model.layers.1.mlp.experts.{weight}"]
        offsets = sorted(tuple(md.chunks.offsets_of(i)) for i in range(len(md.chunks)))
        assert tuple(md.size) == size and offsets == [(0, 0, 0), (2, 0, 0)]  # Shard(0): 2 experts a rank
    # Every rank sent its tokens to the experts' ranks: per MoE layer and forward, one dispatch.
    assert dispatches[name] == [3 * per_step] * 2


def test_each_rank_reads_only_its_own_experts(trained):
    _, _, reads = trained
    # Per expert, its gate rows and its up rows (2 per-expert tensors on disk), and down_proj.
    assert reads == [sorted([(w, e) for e in experts for w in ("down_proj", "gate_up_proj", "gate_up_proj")])
                     for experts in ((0, 1), (2, 3))]


def test_an_expert_parallel_checkpoint_resumes_on_one_process(trained):
    out, dispatches, _ = trained
    assert dispatches[RESUMED] == [3 * EP_RUNS[RESUMED][2]] * 2  # the checkpoint is an EP run's
    one, resumed = last_loss_per_step(out[f"{RESUMED}-one"]), last_loss_per_step(out["resumed"])
    assert sorted(resumed) == [3]
    assert_losses_match(one, resumed, range(3, 4), rel=1e-5)


def _folder(folder, case: str) -> str:
    if case == "not_divisible":  # Qwen3-MoE with 3 experts a layer
        transformers.Qwen3MoeConfig(**SHAPE, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8,
                                    num_experts=3).save_pretrained(folder)
    elif case == "no_gate":  # Nemotron-H: grouped experts without a gate (up -> act -> down)
        transformers.NemotronHConfig(**SHAPE, n_routed_experts=4, num_experts_per_tok=2).save_pretrained(folder)
    elif case == "not_interface":  # JetMoE: its own experts, outside transformers' experts interface
        transformers.JetMoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_local_experts=4,
                                  kv_channels=8, num_key_value_heads=2, num_experts_per_tok=2).save_pretrained(folder)
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


def test_expert_parallel_with_tensor_parallel_is_refused(tmp_path):
    from hyper_parallel.trainer import ConfigError

    folder = _write_folder(tmp_path / "dir", "qwen3_moe", weights=False)
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config([*RUN, f"model.path={folder}", *EP, "parallel.tp=2"]), 4)
    assert ("parallel.ep=2 with parallel.tp=2: model=hf (Qwen3MoeForCausalLM) splits its experts over "
            "data-parallel ranks only; use one of them") in str(err.value).splitlines()[-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # grouped GEMM on CPU; the split path
def test_the_local_experts_compute_each_experts_gated_mlp(dtype):
    from hyper_parallel.models.grouped_experts import ExpertMatmul, expert_matmul
    from hyper_parallel.models.hf_expert_parallel import _local_experts

    generator = torch.Generator().manual_seed(0)
    x, gate_up, down = (torch.randn(*shape, generator=generator, dtype=dtype)
                        for shape in ((7, 8), (3, 8, 8), (3, 8, 4)))
    counts = torch.tensor([3, 0, 4])
    assert (expert_matmul(x, gate_up, down) is ExpertMatmul.GROUPED_MM) == (dtype == torch.float32)
    act = torch.nn.GELU()
    expected = torch.cat([down[e] @ (act(gate_up[e, :4] @ row) * (gate_up[e, 4:] @ row))
                          for e, rows in zip(range(3), x.split(counts.tolist())) for row in rows]).view(7, 8)
    torch.testing.assert_close(_local_experts(act, x, counts, gate_up, down), expected)
