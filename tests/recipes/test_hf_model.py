"""``model=hf model.path=DIR``: transformers' own Llama, Qwen3, Mistral, Gemma 3 (sliding-window
layers), Qwen3-MoE (fused experts, stored per expert) and DeepSeek-V3 (latent attention, MoE)
(tiny configs written here, no downloads) trained by the recipe. Step 1's loss is transformers'
loss with DIR's weights; FSDP2 (activation checkpointing on one family), HSDP and TP2 (Qwen3, from
its own plan, per-head q/k norms included) on 2 ranks, and HSDP 2x2 x EP2 (Qwen3-MoE) and TP2 x
FSDP2 (Qwen3) on 4, train the one-process losses; every family's 2-rank checkpoint
resumes on one process on the uninterrupted curve and exports to a folder transformers loads with
the checkpoint's weights and the same logits; the memory estimate and FLOP count are the model's
own; each process builds the model on meta once (the model validation built is the one trained);
bad folders are refused in one line by ``--check``."""

from __future__ import annotations

import json
from typing import Dict, List
from unittest import mock

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()  # save_pretrained's bar would go to the checked stderr

from hyper_parallel.checkpoint import read_checkpoint_metadata  # noqa: E402
from hyper_parallel.models import hf_causal_lm  # noqa: E402
from hyper_parallel.models.hf_causal_lm import transformers_problem  # noqa: E402
from hyper_parallel.platform import get_platform  # noqa: E402
from hyper_parallel.trainer import compose_config, run_training, validate_config  # noqa: E402
from hyper_parallel.trainer.loop import build_loader  # noqa: E402
from tests.multirank import run_on_ranks  # noqa: E402
from tests.recipes.launch import assert_losses_match, last_loss_per_step  # noqa: E402
from tests.recipes.script_main import script_main  # noqa: E402
from tests.recipes.train_in_process import one_line_error  # noqa: E402

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
# Gemma 3: a sliding-window layer (window 4 < seq_len) and a global one; Qwen3-MoE: transformers'
# fused 3-D experts (its folder holds them per expert); DeepSeek-V3: latent attention, a dense
# layer then an MoE one (grouped routing, a shared expert).
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=16)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SHAPE),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=8),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, sliding_window=None),
    "gemma3": lambda: transformers.Gemma3TextConfig(**SHAPE, head_dim=8, sliding_window=4,
                                                    layer_types=["sliding_attention", "full_attention"]),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SHAPE, **MOE, head_dim=8, num_experts=4),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**SHAPE, "num_key_value_heads": 4}, **MOE, n_routed_experts=4, n_shared_experts=1, n_group=2,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=16),
}
RUN = ["model=hf", "training.seq_len=16", "training.global_batch_size=4", "training.steps=3", "optim.lr=1e-2",
       "optim.warmup_steps=1", "checkpoint.interval=2", "logging.log_every=1"]
# The 2-rank runs of each family: FSDP2 (checkpointing activations on one), HSDP (2 replicas).
TP2 = ["parallel.tp=2", "parallel.dp_shard=1"]  # from the model's base_model_tp_plan
TP_FAMILIES = ("qwen3",)  # its plan: colwise, rowwise and replicated_with_grad_allreduce (q/k norms)
ONE_CHECKPOINT = ["checkpoint.interval=3"]  # the runs that are not resumed save the last step only
LAYOUTS = {"llama": [], "qwen3": ["model.activation_checkpointing=true"], "mistral": ["parallel.dp_replicate=2"],
           "gemma3": [], "qwen3_moe": [], "deepseek_v3": []}
# The 4-rank runs: HSDP 2x2 x EP2 of a mixture of experts (the dense weights sharded over 2 and
# replicated over 2, the experts over the 2 ep ranks of each replica) and TP2 x FSDP2 from Qwen3's plan.
FOUR_RANKS = {"tp2_fsdp2": ("qwen3", ["parallel.tp=2"]),
              "hsdp2x2_ep2": ("qwen3_moe", ["parallel.dp_replicate=2", "parallel.ep=2"])}


def _write_folder(folder, family: str, weights: bool = True) -> str:
    """A tiny transformers model folder: config.json and (with ``weights``) model.safetensors."""
    config = FAMILIES[family]()
    if weights:
        torch.manual_seed(7)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    return str(folder)


def _train(runs: List[List[str]]) -> List[int]:
    """Each run's validation and training on this rank; how often each built the model on meta."""
    builds = []
    for overrides in runs:
        with mock.patch.object(hf_causal_lm, "build_meta", wraps=hf_causal_lm.build_meta) as build_meta:
            run_training(validate_config(compose_config([*RUN, *overrides]), dist.get_world_size()), get_platform())
        builds.append(build_meta.call_count)
    return builds


def _initial_state(path: str, seed: int) -> Dict[str, torch.Tensor]:
    """The model ``path`` builds on this world's mesh with ``seed``, before training, gathered
    whole (rank 0)."""
    from hyper_parallel.trainer.setup.parallelize import build_mesh, build_model

    config = validate_config(compose_config([*RUN, f"model.path={path}"]), dist.get_world_size())
    model = build_model(config.cfg.model, mesh=build_mesh(config.dims, "cpu"), device=torch.device("cpu"), seed=seed)
    state = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}
    return state if dist.get_rank() == 0 else {}


def _trained_weights(checkpoint: str) -> Dict[str, torch.Tensor]:
    """The model's tensors in ``checkpoint``, whole, by their transformers names."""
    from hyper_parallel.checkpoint import load

    stored = read_checkpoint_metadata(checkpoint).state_dict_metadata
    weights = {name[len("model."):]: torch.empty(tuple(md.size), dtype=md.dtype)
               for name, md in stored.items() if name.startswith("model.")}
    load({"model": weights}, checkpoint_id=checkpoint, no_dist=True)
    return weights


def _first_batch(path: str) -> torch.Tensor:
    cfg = validate_config(compose_config([*RUN, f"model.path={path}"]), 1).cfg
    return build_loader(cfg.data, cfg.training, cfg.parallel, cfg.model.vocab_size, 0, 1).next_batch()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Each family's folder and its runs: 2 ranks, one process, and one process resumed from the
    2-rank checkpoint of step 2."""
    root = tmp_path_factory.mktemp("hf")
    paths = {family: _write_folder(root / family, family) for family in FAMILIES}
    out = {family: {kind: str(root / f"{family}-{kind}") for kind in ("two", "one", "resumed", "tp", *FOUR_RANKS)}
           for family in paths}
    builds = run_on_ranks(2, _train, [[f"model.path={paths[f]}", f"output_dir={out[f]['two']}", *LAYOUTS[f]]
                                      for f in paths]
                          + [[f"model.path={paths[f]}", f"output_dir={out[f]['tp']}", *TP2, *ONE_CHECKPOINT]
                             for f in TP_FAMILIES], timeout=300)
    run_on_ranks(4, _train, [[f"model.path={paths[f]}", f"output_dir={out[f][kind]}", *layout, *ONE_CHECKPOINT]
                             for kind, (f, layout) in FOUR_RANKS.items()], timeout=300)
    paths["init"] = _write_folder(root / "init", "llama", weights=False)  # the model's own initialisation
    out["init"] = {"states": [run_on_ranks(n, _initial_state, paths["init"], seed, timeout=120)[0]
                              for n, seed in ((2, 0), (1, 0), (1, 1))]}
    builds += run_on_ranks(1, _train, [[f"model.path={paths[f]}", f"output_dir={out[f]['one']}", *ONE_CHECKPOINT]
                                       for f in FAMILIES]
                           + [[f"model.path={paths[f]}", f"output_dir={out[f]['resumed']}",
                               f"checkpoint.load_from={out[f]['two']}/checkpoints/step-2"] for f in FAMILIES],
                           timeout=300)
    out["builds"] = builds  # per rank, per run
    return paths, out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_steps_match_transformers_one_process_and_resume(trained, family):
    paths, out = trained
    one, two, resumed = (last_loss_per_step(out[family][kind]) for kind in ("one", "two", "resumed"))
    model = transformers.AutoModelForCausalLM.from_pretrained(paths[family], attn_implementation="sdpa")
    batch = _first_batch(paths[family])
    with torch.no_grad():
        expected = float(model(input_ids=batch, labels=batch).loss)
    assert abs(one[1] - expected) <= 1e-5 * expected, (one[1], expected)
    assert sorted(one) == sorted(two) == [1, 2, 3]
    assert one[3] < one[1]
    assert_losses_match(one, two, rel=1e-5)        # 2 ranks (FSDP2 or HSDP): reduction order only
    assert sorted(resumed) == [3]
    assert_losses_match(one, resumed, range(3, 4), rel=1e-5)


@pytest.mark.parametrize("kind", list(FOUR_RANKS))
def test_hsdp_2x2_x_ep2_and_tp2_x_fsdp2_on_four_ranks_train_the_one_process_losses(trained, kind):
    _, out = trained
    family = FOUR_RANKS[kind][0]
    stored = read_checkpoint_metadata(f"{out[family][kind]}/checkpoints/step-3").state_dict_metadata
    name, chunks = {"hsdp2x2_ep2": ("mlp.experts.gate_up_proj", 2),  # over the 2 ep ranks, replicated over 2
                    "tp2_fsdp2": ("self_attn.q_proj.weight", 4)}[kind]  # rows over tp x dp_shard
    assert len(stored[f"model.model.layers.0.{name}"].chunks) == chunks
    one, four = (last_loss_per_step(out[family][run]) for run in ("one", kind))
    assert sorted(four) == [1, 2, 3]
    assert_losses_match(one, four, rel=1e-5)


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tensor_parallel_from_the_models_plan_trains_the_one_process_losses(trained, family):
    _, out = trained
    stored = read_checkpoint_metadata(f"{out[family]['tp']}/checkpoints/step-3").state_dict_metadata
    q_proj, lm_head = stored["model.model.layers.0.self_attn.q_proj.weight"], stored["model.lm_head.weight"]
    assert tuple(q_proj.size) == (32, 32) and len(q_proj.chunks) == 2  # its heads split over the tp ranks
    assert len(lm_head.chunks) == 1  # replicated over tp: stored once
    # The per-head q/k norms: replicated (stored once), their gradients summed over the tp ranks'
    # heads: trained as on one process (each rank's own heads' gradients alone move them 0.02 off).
    assert len(stored["model.model.layers.0.self_attn.q_norm.weight"].chunks) == 1
    tp, one = (_trained_weights(f"{out[family][kind]}/checkpoints/step-3") for kind in ("tp", "one"))
    norms = {name: float((tp[name] - one[name]).abs().max()) for name in one
             if name.endswith(("q_norm.weight", "k_norm.weight"))}
    assert len(norms) == 4 and max(norms.values()) < 1e-5, norms
    assert_losses_match(last_loss_per_step(out[family]["one"]), last_loss_per_step(out[family]["tp"]), rel=1e-5)


def test_fused_experts_are_sharded_on_the_expert_dim_and_read_from_per_expert_tensors(trained):
    paths, out = trained
    stored = read_checkpoint_metadata(f"{out['qwen3_moe']['two']}/checkpoints/step-3").state_dict_metadata
    gate_up = stored["model.model.layers.0.mlp.experts.gate_up_proj"]
    offsets = sorted(gate_up.chunks.offsets_of(i)[0] for i in range(len(gate_up.chunks)))
    assert tuple(gate_up.size) == (4, 32, 32) and offsets == [0, 2]  # 2 experts a rank
    from safetensors import safe_open

    with safe_open(f"{paths['qwen3_moe']}/model.safetensors", "pt") as folder:
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in folder.keys()  # the step-1 loss read these


def test_each_process_builds_the_model_once_for_validation_and_training(trained):
    _, out = trained
    two, one = len(FAMILIES) + len(TP_FAMILIES), 2 * len(FAMILIES)
    assert out["builds"] == [[1] * two, [1] * two, [1] * one]  # 2 ranks' runs, then 1 rank's


def test_without_weights_the_models_own_init_is_the_same_on_every_mesh(trained):
    paths, out = trained
    sharded, whole, other_seed = out["init"]["states"]
    assert sorted(sharded) == sorted(whole) and all(torch.equal(sharded[k], whole[k]) for k in whole)
    assert not torch.equal(whole["model.embed_tokens.weight"], other_seed["model.embed_tokens.weight"])
    # transformers' own initialisation (normal of initializer_range, norms at one), not the folder's
    # weights (it has none) nor the llama folder's.
    q = whole["model.layers.0.self_attn.q_proj.weight"]
    assert abs(float(q.std()) - 0.02) < 0.004 and torch.equal(whole["model.norm.weight"], torch.ones(32))
    from safetensors.torch import load_file

    llama = load_file(f"{paths['llama']}/model.safetensors")
    assert not torch.equal(q, llama["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_checkpoints_hold_transformers_names_and_export_loads(trained, tmp_path, family):
    paths, out = trained
    checkpoint = f"{out[family]['two']}/checkpoints/step-3"
    stored = read_checkpoint_metadata(checkpoint).state_dict_metadata
    assert "model.model.layers.0.input_layernorm.weight" in stored and "model.lm_head.weight" in stored
    dtypes = ("float32", "bfloat16") if family == "qwen3" else ("float32",)
    exported = {}
    for dtype in dtypes:
        folder = tmp_path / dtype
        assert script_main("export_hf")([checkpoint, str(folder), "--dtype", dtype]) == 0
        model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert not any(info.values()), info
        assert json.loads((folder / "config.json").read_text())["dtype"] == dtype
        exported[dtype] = model
    from safetensors.torch import load_file

    trained_state = _trained_weights(checkpoint)
    weights = exported["float32"].state_dict()
    assert sorted(weights) == sorted(trained_state)
    assert all(torch.equal(weights[k], v) for k, v in trained_state.items())
    if "bfloat16" in exported:
        bf16 = load_file(tmp_path / "bfloat16" / "model-00001-of-00001.safetensors")
        assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    # The same logits as the model of DIR's config holding the trained weights.
    reference = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(paths[family]))
    reference.load_state_dict(trained_state)
    batch = _first_batch(paths[family])
    with torch.no_grad():
        assert torch.equal(exported["float32"](batch).logits, reference(batch).logits)


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma3", "deepseek_v3"])
def test_the_flop_count_and_memory_estimate_are_the_models_own(trained, family):
    """Counted over the model's modules, not a Llama of its sizes: routed experts at top_k / experts,
    a tied head as a head, a sliding-window layer over its window, latent attention's head sizes."""
    from hyper_parallel.models import hf_sizes
    from hyper_parallel.trainer.launch.preflight import estimate_memory

    paths, out = trained
    config = validate_config(compose_config([*RUN, f"model.path={paths[family]}"]), 1)
    model, text = config.meta_model, config.meta_model.config
    assert estimate_memory(config.cfg, config.dims, model).parameters == sum(p.numel() for p in model.parameters())
    routed = 128 + (4 * 32 * 32 + 4 * 32 * 16) * 2 // 4  # a router, and 2 of 4 experts (gate/up, down)
    mlps = {"qwen3_moe": [routed, routed], "gemma3": [3 * 32 * 48] * 2,
            "deepseek_v3": [3 * 32 * 48, routed + 3 * 32 * 16]}[family]  # dense, then experts + a shared one
    attention = [sum(p.numel() for p in layer.self_attn.parameters() if p.ndim == 2) for layer in model.model.layers]
    head = 64 * 32  # the output layer (Gemma 3's is tied to the embedding: counted as the head)
    assert hf_sizes.matmul_params(model) == sum(attention) + sum(mlps) + head
    qk, v = (8, 16) if family == "deepseek_v3" else (8, 8)  # latent attention: its own head sizes
    keys = [4, 16] if family == "gemma3" else [16, 16]  # Gemma 3's layer 0 slides over 4 tokens
    flops = 6 * hf_sizes.matmul_params(model) + sum(6 * 4 * (qk + v) * k for k in keys)
    assert hf_sizes.flops_per_token(model, 16) == flops
    # The run's throughput is counted with it: TFLOP/s x world / tokens/s is the count per token.
    record = json.loads(open(f"{out[family]['one']}/metrics.jsonl").readline())
    assert record["tflops"] * 1e12 / record["tokens_per_s"] == pytest.approx(flops, rel=1e-6)


def test_the_load_balancing_loss_of_output_router_logits_is_trained_as_transformers_adds_it(tmp_path):
    """One process, in place of a recipe step: the gradients of the recipe's loss (``scale x``
    the cross entropy, the balancing loss carried by the logits) are those of ``scale x``
    transformers' cross entropy + ``router_aux_loss_coef x aux_loss``."""
    from hyper_parallel.models.hf_weights import load_weights
    from hyper_parallel.trainer.step.train_step import next_token_loss

    config = FAMILIES["qwen3_moe"]()
    config.output_router_logits, config.router_aux_loss_coef = True, 0.5  # large: its gradients stand out
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = hf_causal_lm.build_meta(hf_causal_lm.read_config(str(tmp_path)))
    model.to_empty(device="cpu")
    model.init_from_seed(0)
    load_weights(model, str(tmp_path))
    batch = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    model.set_aux_loss_scale(0.5)  # as for 2 micro-batches
    (next_token_loss(model, batch) * 0.5).backward()
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    out = reference(input_ids=batch[:, :-1])
    cross_entropy = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten())
    ((cross_entropy + 0.5 * out.aux_loss) * 0.5).backward()
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name].grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("case, overrides, expected", [
    ("no_config", [], "has no config.json"),
    ("not_causal", [], "is not a causal language model"),
    ("unknown_type", [], "is not a config this transformers"),
    ("wrong_shape", [], "weights do not match config.json: model.embed_tokens.weight (64, 32) (config.json: (32, 32))"),
    ("wrong_names", [], "the weights lack model.layers.2.self_attn.q_proj.weight"),
    ("qwen3_moe", ["parallel.tp=2"], "parallel.tp: Qwen3MoeForCausalLM's tensor-parallel plan has entries without a "
                                     "torch style here (layers.*.mlp.experts.gate_up_proj: packed_colwise"),
    ("router_logits", [], "config.json: output_router_logits=true, but DeepseekV3ForCausalLM has no load-balancing"),
    ("llama", ["model.dim=48"], "model.dim is read from"),
])
def test_a_bad_folder_or_setting_is_one_line(tmp_path, check, case, overrides, expected):
    folder = tmp_path / "dir"
    if case == "no_config":
        folder.mkdir()
    elif case == "not_causal":
        transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                               intermediate_size=48).save_pretrained(folder)
    elif case == "unknown_type":
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "no_such_model", "vocab_size": 64}))
    elif case == "wrong_shape":
        _write_folder(folder, "llama")
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 32}))
    elif case == "wrong_names":
        _write_folder(folder, "llama")
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    elif case == "router_logits":
        _write_folder(folder, "deepseek_v3", weights=False)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "output_router_logits": True}))
    else:
        _write_folder(folder, case, weights=False)
    one_line_error(*check("model=hf", f"model.path={folder}", *overrides)[::2], expected)


def test_a_transformers_version_outside_the_tested_range_is_named():
    assert transformers_problem(transformers.__version__) == []
    assert "tested with transformers >=5.23,<6.0; this environment has 4.57.1" in transformers_problem("4.57.1")[0]
    assert transformers_problem("6.0.0.dev0")
