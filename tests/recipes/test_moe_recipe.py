"""The recipe with a mixture-of-experts model (``model=moe_debug``): sharded training against one
process, its config checks. In-process on the shared gloo rank pools."""

from __future__ import annotations

import re
import sys
from typing import List

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.platform import get_platform
from hyper_parallel.trainer import compose_config, run_training, validate_config
from hyper_parallel.trainer.config.compose import ConfigError
from hyper_parallel.trainer.config.parallel import ParallelDims
from hyper_parallel.trainer.launch.reporting import layout
from tests.multirank import run_on_ranks
from tests.recipes.launch import assert_losses_match, last_loss_per_step, read_metrics, run

MOE = ["model=moe_debug", "training.seq_len=32", "training.global_batch_size=8", "training.steps=4",
       "optim.lr=1e-2", "optim.warmup_steps=1", "logging.log_every=1", "checkpoint.interval=100"]


def _train(overrides: List[str]) -> None:
    cfg = compose_config([*MOE, *overrides])
    run_training(validate_config(cfg, dist.get_world_size()), get_platform())


def test_fsdp2_matches_one_process_with_the_aux_loss(tmp_path):
    # The ranks balance the global batch together, so one process on the same batch is the same
    # training as FSDP on 2 ranks.
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    run_on_ranks(1, _train, [f"output_dir={one}"], timeout=180)
    run_on_ranks(2, _train, [f"output_dir={two}"], timeout=180)
    expected = last_loss_per_step(one)
    assert sorted(expected) == [1, 2, 3, 4] and expected[4] < expected[1]
    assert_losses_match(expected, last_loss_per_step(two), rel=1e-5)
    # metrics.jsonl: the aux loss and the load balance of the step's global batch, the same on
    # one process and two (the ranks' token counts are summed).
    for a, b in zip(read_metrics(one), read_metrics(two)):
        assert a["aux_loss"] > 0 and abs(a["aux_loss"] - b["aux_loss"]) <= 1e-5 * a["aux_loss"], (a, b)
        assert len(a["expert_load_per_block"]) == 2 and a["expert_load"] == max(a["expert_load_per_block"])
        assert 1 < a["expert_load"] <= 8 / 2 and abs(a["expert_load"] - b["expert_load"]) < 1e-9, (a, b)
    # The aux loss is in the backward: without it the same run trains differently.
    plain = str(tmp_path / "plain")
    run_on_ranks(1, _train, [f"output_dir={plain}", "model.moe.aux_loss_weight=0"], timeout=180)
    unbalanced = last_loss_per_step(plain)
    assert unbalanced[1] == expected[1] and abs(unbalanced[4] - expected[4]) > 1e-5 * expected[4]


def test_expert_parallel_ep2_matches_ep1(tmp_path):
    # ep=2 on 2 ranks: each rank holds 4 of the 8 experts (efsdp of 1 rank); the experts'
    # gradients must be averaged over the 2 dp_shard ranks like the dense ones.
    ep1, ep2 = str(tmp_path / "ep1"), str(tmp_path / "ep2")
    run_on_ranks(2, _train, [f"output_dir={ep1}"], timeout=180)
    run_on_ranks(2, _train, [f"output_dir={ep2}", "parallel.ep=2"], timeout=180)
    expected = last_loss_per_step(ep1)
    assert sorted(expected) == [1, 2, 3, 4]
    assert_losses_match(expected, last_loss_per_step(ep2), rel=1e-5)
    norms = [(a["grad_norm"], b["grad_norm"]) for a, b in zip(read_metrics(ep1), read_metrics(ep2))]
    assert len(norms) == 4 and all(abs(a - b) <= 1e-5 * a for a, b in norms), norms


@pytest.mark.parametrize("override, message", [
    ("parallel.ep=3", "parallel.ep=3 does not divide model.moe.num_experts=8 (each ep rank holds num_experts / ep "
                      "experts)"),
    ("parallel.ep=4", "parallel.ep=4 does not divide the 2 dp_shard ranks"),
    ("parallel.dp_replicate=2 parallel.ep=2", "parallel.ep=2 does not divide the 1 dp_shard ranks"),
    ("model.moe.top_k=9", "model.moe: top_k=9 is more than num_experts=8"),
    ("model.moe.first_k_dense=1", "model.moe: first_k_dense=1 dense blocks need ffn_hidden_dim > 0"),
    ("parallel.tp=2", "parallel.tp=2 with model.moe is not supported yet"),
    ("model.init_from=/x model.moe.router_bias=true",
     "model.init_from=/x: transformers' Qwen3-MoE has no equivalent of router_bias=True"),
])
def test_moe_config_refusals(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(compose_config([*MOE, *override.split()]), 2)


# The Qwen3-MoE config of model=moe_debug's shape (transformers' names).
QWEN3_MOE_DEBUG = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=64, intermediate_size=128, norm_topk_prob=True,
                       max_position_embeddings=256, rms_norm_eps=1e-6)


def _qwen3_moe_dir(path):
    """A random transformers Qwen3MoeForCausalLM of moe_debug's shape, saved with save_pretrained;
    the norms far from 1 so that a permutation or name mix-up shows."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**QWEN3_MOE_DEBUG))
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(torch.randn(param.shape) * (0.2 if param.ndim > 1 else 1.0))
    hf.save_pretrained(path)
    return hf.eval()


def test_init_from_a_transformers_qwen3_moe_directory_under_pp2_ep2_starts_at_its_loss(tmp_path):
    # 4 ranks: 2 stages of one block, each stage's experts over ep=2; every rank reads its own
    # stage's tensors (of its experts) and the ranks plan the load together.
    from hyper_parallel.trainer.config import typed_config
    from hyper_parallel.trainer.loop import build_loader

    hf = _qwen3_moe_dir(tmp_path / "hf")
    overrides = [f"output_dir={tmp_path / 'run'}", "training.steps=1", f"model.init_from={tmp_path / 'hf'}"]
    run_on_ranks(4, _train, [*overrides, "parallel.pp=2", "parallel.pp_microbatches=2", "parallel.ep=2"], timeout=180)
    cfg = typed_config(compose_config([*MOE, *overrides]))
    batch = build_loader(cfg.data, cfg.training, cfg.parallel, 256, dp_rank=0, dp_size=1).next_batch()
    with torch.no_grad():
        expected = hf(batch, labels=batch).loss.item()  # transformers' own loss (it shifts the labels)
    assert read_metrics(str(tmp_path / "run"))[0]["loss"] == pytest.approx(expected, rel=1e-5)


def test_llama_only_tools_refuse_an_moe_model():
    from hyper_parallel.trainer.config import llama_config

    with pytest.raises(ValueError, match=r"^model\.moe is set: a mixture of experts has no LlamaConfig"):
        llama_config(compose_config(MOE).model)


def test_ep_needs_an_moe_model():
    with pytest.raises(ConfigError, match=r"^parallel\.ep=2 needs a mixture-of-experts model \(model\.moe\)"):
        validate_config(compose_config(["parallel.ep=2"]), 2)


def test_progress_line_and_mfu_count_active_parameters(tmp_path):
    import io

    from hyper_parallel.models.moe import MoEConfig, build_moe
    from hyper_parallel.trainer.observability.metrics import MetricsLogger, moe_record
    from hyper_parallel.trainer.observability.performance import matmul_params

    # 2 blocks of 4 experts over 2 ranks: block 0 balanced, block 1 with one expert at 4x the mean.
    record = moe_record([0.5, *[2.0] * 4, 8.0, 0.0, 0.0, 0.0], loss_ranks=2, num_experts=4)
    assert record == {"aux_loss": 0.25, "expert_load": 4.0, "expert_load_per_block": [1.0, 4.0]}
    out = io.StringIO()
    log = MetricsLogger(str(tmp_path), total_steps=1, is_main=True, stream=out)
    log.log_step({"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, **record})
    log.close()
    assert "aux 0.2500  expert load 4.00" in out.getvalue(), out.getvalue()

    cfg = MoEConfig(**{**dict(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2), "num_experts": 8,
                       "top_k": 2, "moe_ffn_dim": 64})
    model = build_moe("moe_debug", aux_loss_weight=0.0)
    idle = 2 * (8 - 2) * 3 * 32 * 64  # per block: the 6 experts a token is not sent to
    assert matmul_params(cfg) == model.num_params() - 256 * 32 - idle


def test_resume_an_ep2_checkpoint_on_one_process(tmp_path):
    ref, ep2, one = (str(tmp_path / name) for name in ("ref", "ep2", "one"))
    run_on_ranks(2, _train, [f"output_dir={ref}", "parallel.ep=2"], timeout=180)
    assert layout(validate_config(compose_config([*MOE, "parallel.ep=2"]), 2).cfg, ParallelDims(1, 2)) == \
        "mesh 2 (shard), experts over ep 2 x efsdp 1, fp32"
    run_on_ranks(2, _train, [f"output_dir={ep2}", "parallel.ep=2", "training.stop_after_steps=2"], timeout=180)
    # One process, the same settings (the global batch balanced as the two ranks balanced it).
    run_on_ranks(1, _train, [f"output_dir={one}", f"checkpoint.load_from={ep2}/checkpoints/step-2"], timeout=180)
    assert sorted(last_loss_per_step(ep2)) == [1, 2] and sorted(last_loss_per_step(one)) == [3, 4]
    assert_losses_match(last_loss_per_step(ref), last_loss_per_step(one), range(3, 5), rel=1e-5)
    # The experts (and their optimizer moments) are saved as global [num_experts, ...] tensors.
    listing = run([sys.executable, "-m", "hyper_parallel.checkpoint", "inspect", f"{ep2}/checkpoints/step-2"]).stdout
    for name in ("model.layers.1.moe.experts.w2", "optim.state.layers.0.moe.experts.w1.exp_avg_sq"):
        shape = "8x32x64" if name.endswith("w2") else "8x64x32"
        pattern = rf"{re.escape(name)}\s+float32\s+{shape}\s.*mesh 1x2 \(efsdp,ep\)"
        assert re.search(pattern, listing), listing


def test_ep_with_hsdp_matches_ep1_and_resumes_on_one_process(tmp_path):
    # HSDP 2 x 2 with ep=2: each replica's 2 dp_shard ranks split the experts (efsdp 1), the
    # experts replicated over the replicas; the same training as ep=1 on the same mesh.
    ep1, ep2, one = (str(tmp_path / name) for name in ("ep1", "ep2", "one"))
    hsdp = ["parallel.dp_replicate=2"]
    run_on_ranks(4, _train, [f"output_dir={ep2}", *hsdp, "parallel.ep=2", "checkpoint.interval=2"], timeout=180)
    run_on_ranks(4, _train, [f"output_dir={ep1}", *hsdp], timeout=180)
    assert layout(validate_config(compose_config([*MOE, *hsdp, "parallel.ep=2"]), 4).cfg, ParallelDims(2, 2)) == \
        "mesh 2x2 (replicate, shard), experts over ep 2 x efsdp 1 x replicate 2, fp32"
    expected = last_loss_per_step(ep1)
    assert sorted(expected) == [1, 2, 3, 4]
    assert_losses_match(expected, last_loss_per_step(ep2), rel=1e-5)
    norms = [(a["grad_norm"], b["grad_norm"]) for a, b in zip(read_metrics(ep1), read_metrics(ep2))]
    assert len(norms) == 4 and all(abs(a - b) <= 1e-5 * a for a, b in norms), norms
    # Its step-2 checkpoint resumes on one process with the same settings (the global batch
    # balanced as the 4 ranks balanced it) and continues the uninterrupted curve.
    run_on_ranks(1, _train, [f"output_dir={one}", f"checkpoint.load_from={ep2}/checkpoints/step-2"], timeout=180)
    assert sorted(last_loss_per_step(one)) == [3, 4]
    assert_losses_match(expected, last_loss_per_step(one), range(3, 5), rel=1e-5)
