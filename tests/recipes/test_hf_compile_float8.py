"""``model=hf`` with ``training.compile``, ``training.float8`` and ``training.loss_chunks``
(transformers' own models, tiny configs written here). On 2 ranks, compiled decoder layers
(aot_eager with activation checkpointing: Qwen3-MoE's compiled around the checkpoint under FSDP2,
Llama's inside it under TP2) and the chunked loss (Qwen3-MoE under FSDP2, Llama under CP2) train
the eager one-process losses; float8 runs Qwen3-MoE's attention linears in float8 (gathered as
float8 bytes) and keeps lm_head, the routers (PhiMoE's, an ``nn.Linear`` subclass, too) and the
3-D experts in high precision. On one process, the chunked loss is the model's own (logit
soft-capping included, the load-balancing loss in its backward) without the whole logits, and
with router logits (recorded by hooks dynamo cannot trace) the layers compile around them; a
model float8 cannot run is refused in one line."""

from __future__ import annotations

from typing import Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from hyper_parallel._optional import available  # noqa: E402
from hyper_parallel._torch_compat import dynamo_graphs_compiled  # noqa: E402
from hyper_parallel.models import hf_causal_lm  # noqa: E402
from hyper_parallel.models.float8 import convert_to_float8  # noqa: E402
from hyper_parallel.platform import get_platform  # noqa: E402
from hyper_parallel.trainer import compose_config, run_training, validate_config  # noqa: E402
from hyper_parallel.trainer.config.model import ModelConfig  # noqa: E402
from hyper_parallel.trainer.setup.parallelize import parallelize  # noqa: E402
from hyper_parallel.trainer.step.train_step import next_token_loss  # noqa: E402
from tests.multirank import run_on_ranks  # noqa: E402
from tests.recipes.launch import assert_losses_match, last_loss_per_step  # noqa: E402
from tests.recipes.test_hf_model import FAMILIES, RUN, SHAPE, _write_folder  # noqa: E402
from tests.recipes.train_in_process import one_line_error  # noqa: E402

ONCE = ["checkpoint.interval=3"]
COMPILE = ["training.compile=true", "training.compile_backend=aot_eager", "model.activation_checkpointing=true"]
CHUNKS = ["training.loss_chunks=3"]
# The 2-rank runs: (family, name, overrides).
RUNS = [("qwen3_moe", "compiled", COMPILE),                                                # compile_blocks
        ("llama", "compiled_tp2", [*COMPILE, "parallel.tp=2", "parallel.dp_shard=1"]),  # compile_block_forwards
        ("qwen3_moe", "chunks", CHUNKS), ("llama", "chunks_cp2", [*CHUNKS, "parallel.cp=2"])]
# Qwen3-MoE's load-balancing loss, large: its gradients stand out.
ROUTER_LOGITS = {"output_router_logits": True, "router_aux_loss_coef": 0.5}


def _train(runs: List[List[str]]) -> List[int]:
    """Each run's validation and training on this rank; how many graphs dynamo compiled for it."""
    graphs = []
    for overrides in runs:
        torch.compiler.reset()  # the rank processes are reused: no graph cached by an earlier run
        before = dynamo_graphs_compiled()
        run_training(validate_config(compose_config([*RUN, *ONCE, *overrides]), dist.get_world_size()), get_platform())
        graphs.append(dynamo_graphs_compiled() - before)
    return graphs


def _float8_steps(path: str, recipe: Optional[str]):
    """3 steps of ``path``'s model on this rank's batches (``recipe``: float8, None: float32): the
    losses, the collectives' payload dtypes, and which of its modules are torchao's float8 linears."""
    from hyper_parallel.core.fully_shard import collectives
    from hyper_parallel.data import DistributedBatchLoader, MarkovSource
    from hyper_parallel.trainer import train_step
    from hyper_parallel.trainer.setup.optimizer import build_optimizer
    from hyper_parallel.trainer.setup.parallelize import build_mesh, build_model

    valid = validate_config(compose_config([*RUN, f"model.path={path}", "training.float8=true"]), dist.get_world_size())
    model = build_model(valid.cfg.model, mesh=build_mesh(valid.dims, "cpu"), device=torch.device("cpu"), seed=0,
                        float8_recipe=recipe, meta_model=valid.meta_model)
    float8 = {name: type(module).__name__ == "Float8Linear" for name, module in model.named_modules()
              if name.endswith(("q_proj", "o_proj", "lm_head", "mlp.gate", "mlp.experts"))}
    opt = build_optimizer(model, valid.cfg.optim)
    loader = DistributedBatchLoader(MarkovSource(64, 16, seed=1), 4, dp_rank=dist.get_rank(),
                                    dp_size=dist.get_world_size())
    losses, gathered = [], set()
    for _ in range(3):
        collectives.reset_collective_counts()
        result = train_step(model, loader.next_batch(), opt, grad_accum_steps=1, max_grad_norm=1.0,
                            float8_scales=recipe == "tensorwise")
        gathered |= {str(dtype) for _, dtype in collectives.collective_bytes()}
        losses.append(float(result["loss"]))
    return losses, sorted(gathered), float8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The losses of the 2-rank runs (:data:`RUNS`) and of the eager one-process ones, the graphs
    each 2-rank run compiled; Qwen3-MoE's float8 and float32 steps on 2 ranks."""
    root = tmp_path_factory.mktemp("hf-fast")
    paths = {family: _write_folder(root / family, family) for family in ("llama", "qwen3_moe")}
    graphs = run_on_ranks(2, _train, [[f"model.path={paths[f]}", f"output_dir={root / f'{f}-{name}'}", *o]
                                      for f, name, o in RUNS], timeout=300)[0]
    run_on_ranks(1, _train, [[f"model.path={paths[f]}", f"output_dir={root / f'{f}-one'}"] for f in paths], timeout=300)
    float8 = {recipe: run_on_ranks(2, _float8_steps, paths["qwen3_moe"], recipe, timeout=180)
              for recipe in ("tensorwise", None)} if available("torchao") else None
    losses = {(f, name): last_loss_per_step(str(root / f"{f}-{name}"))
              for f, name in [(f, name) for f, name, _ in RUNS] + [(f, "one") for f in paths]}
    return {"graphs": dict(zip([(f, name) for f, name, _ in RUNS], graphs)), "losses": losses, "float8": float8}


@pytest.mark.parametrize("family, name", [(f, name) for f, name, _ in RUNS])
def test_two_ranks_compiled_or_chunked_train_the_eager_one_process_losses(runs, family, name):
    expected, actual = runs["losses"][(family, "one")], runs["losses"][(family, name)]
    assert sorted(actual) == [1, 2, 3] and expected[3] < expected[1]
    assert_losses_match(expected, actual, rel=1e-5)  # float32: summation order only
    # The decoder layers are compiled whole (all alike: one graph) in the compiled runs only.
    assert runs["graphs"][(family, name)] == (1 if name.startswith("compiled") else 0)


def test_float8_runs_the_dense_linears_and_keeps_the_head_routers_and_experts_high_precision(runs):
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'hyper_parallel[float8]')")
    for (losses, gathered, float8), (reference, _, plain) in zip(*runs["float8"].values()):
        assert not any(plain.values())
        assert {name.split(".", 3)[-1] for name, on in float8.items() if on} == {"self_attn.q_proj",
                                                                                 "self_attn.o_proj"}, float8
        assert {name for name, on in float8.items() if not on} >= {"lm_head", "model.layers.0.mlp.gate",
                                                                   "model.layers.0.mlp.experts"}, float8
        assert "torch.uint8" in gathered, gathered  # tensorwise: the weights gathered as float8 bytes
        # The same model and batches: float8 rounding moves the first loss a little, not more.
        assert losses[0] != reference[0] and abs(losses[0] - reference[0]) < 0.02 * reference[0], (losses, reference)
        assert losses[-1] < losses[0], losses


def test_float8_keeps_a_linear_subclass_high_precision():
    """PhiMoE's router is an ``nn.Linear`` subclass (its forward picks the experts) of a size float8
    takes (32 -> 16 experts): a float8 linear in its place would drop the routing."""
    pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'hyper_parallel[float8]')")
    model = hf_causal_lm.build_meta(transformers.PhimoeConfig(**SHAPE, num_local_experts=16, num_experts_per_tok=2))
    convert_to_float8(model, "tensorwise")
    layer = model.layers["0"]
    assert type(layer.mlp.router).__name__ == "PhimoeTopKRouter"
    assert type(layer.self_attn.q_proj).__name__ == "Float8Linear"


def _loss_and_grads(family: str, chunks: int, config_keys: Dict[str, object], compile_backend: Optional[str] = None):
    """One process: the recipe's loss of one batch with ``chunks`` loss chunks (the model built as
    the recipe builds it, checkpointing activations and compiled with ``compile_backend``), its
    gradients, and the sequence lengths lm_head saw."""
    config = FAMILIES[family]()
    for key, value in config_keys.items():
        setattr(config, key, value)
    torch.compiler.reset()
    model = parallelize(hf_causal_lm.build_meta(config), ModelConfig(activation_checkpointing=True), mesh=None,
                        device=torch.device("cpu"), seed=0, compile_backend=compile_backend)
    seen: List[int] = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    batch = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = next_token_loss(model, batch, chunks)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, seen


def _assert_same_loss_and_grads(actual, expected) -> None:
    """float32: summation order only (a lost balancing loss moves the router's gradients by 1e-3)."""
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-6, atol=0)
    for name, grad in expected[1].items():
        torch.testing.assert_close(actual[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("family, config_keys", [
    ("gemma3", {"final_logit_softcapping": 2.0}),  # after lm_head: the model's own forward makes the logits
    ("qwen3_moe", ROUTER_LOGITS),
])
def test_the_chunked_loss_is_the_models_own_loss_and_never_makes_whole_logits(family, config_keys):
    whole, chunked = _loss_and_grads(family, 1, config_keys), _loss_and_grads(family, 3, config_keys)
    _assert_same_loss_and_grads(chunked, whole)
    # 16 tokens in pieces of 6, 6, 4 (the forward, then each again in the backward); with router
    # logits also the balancing loss's call with no tokens.
    assert sorted(set(chunked[2])) == ([0] if "output_router_logits" in config_keys else []) + [4, 6], chunked[2]


def test_with_router_logits_the_layers_compile_around_the_hooks_that_record_them():
    """transformers records router logits by forward hooks that read a ContextVar: a graph break
    in each layer, so the checkpoint wraps the compiled layer forward (its whole would fail)."""
    eager = _loss_and_grads("qwen3_moe", 1, ROUTER_LOGITS)
    before = dynamo_graphs_compiled()
    compiled = _loss_and_grads("qwen3_moe", 1, ROUTER_LOGITS, compile_backend="aot_eager")
    assert dynamo_graphs_compiled() - before > 1
    _assert_same_loss_and_grads(compiled, eager)


def test_float8_without_a_linear_that_can_run_it_is_one_line(tmp_path, check):
    transformers.LlamaConfig(**{**SHAPE, "hidden_size": 24}).save_pretrained(tmp_path)
    one_line_error(*check("model=hf", f"model.path={tmp_path}", "training.float8=true")[::2],
                   "training.float8=true, but no linear layer of LlamaForCausalLM can run in float8 (in and out sizes "
                   f"must be multiples of 16; its blocks' linears are 24->12, 24->24, 24->48, 48->24 in {tmp_path}/"
                   "config.json)")
