"""``parallel.mixed_precision``: the dtypes the recipe's sharded model actually computes in (the
project's Llama, and a ``transformers`` Qwen3 under ``model=hf``)."""

import pytest
import torch
import torch.distributed as dist

from hyper_parallel.data import DistributedBatchLoader, MarkovSource
from hyper_parallel.trainer import compose_config, train_step, validate_config
from hyper_parallel.trainer.setup.optimizer import build_optimizer
from hyper_parallel.trainer.setup.parallelize import build_mesh, build_model
from tests.multirank import run_on_ranks


def _dtypes_in_one_step(precision: str, hf_path: str = None):
    model_keys = ([f"model.path={hf_path}"] if hf_path else ["model.dim=32", "model.n_layers=2"])
    cfg = compose_config([*model_keys, "model.activation_checkpointing=true", f"parallel.mixed_precision={precision}"])
    config = validate_config(cfg, dist.get_world_size())
    model = build_model(config.cfg.model, mesh=build_mesh(config.dims, "cpu"), device=torch.device("cpu"), seed=0,
                        mixed_precision=precision, meta_model=config.meta_model)
    seen = {}

    def record(name):
        def hook(module, inputs, output):
            seen[name] = (str(module.weight.dtype), str(inputs[0].dtype), str(output.dtype))
        return hook

    if hf_path:
        model.model.layers[1].self_attn.q_proj.register_forward_hook(record("wq"))
        model.lm_head.register_forward_hook(record("output"))
    else:
        model.layers["1"].attention.wq.register_forward_hook(record("wq"))
        model.output.register_forward_hook(record("output"))
    vocab = config.cfg.model.vocab_size
    loader = DistributedBatchLoader(MarkovSource(vocab, 16, seed=1), 8, dp_rank=dist.get_rank(),
                                    dp_size=dist.get_world_size())
    result = train_step(model, loader.next_batch(), build_optimizer(model, cfg.optim), grad_accum_steps=1,
                        max_grad_norm=1.0)
    master = sorted({str(p.dtype) for p in model.parameters()})
    return seen, master, str(result["loss"].dtype)


def test_bf16_computes_in_bf16_and_keeps_fp32_master_weights():
    for seen, master, loss_dtype in run_on_ranks(2, _dtypes_in_one_step, "bf16", timeout=120):
        assert seen["wq"] == ("torch.bfloat16",) * 3 and seen["output"] == ("torch.bfloat16",) * 3
        assert master == ["torch.float32"] and loss_dtype == "torch.float32"
    for seen, master, loss_dtype in run_on_ranks(2, _dtypes_in_one_step, "fp32", timeout=120):
        assert seen["wq"] == ("torch.float32",) * 3 and master == ["torch.float32"]


def test_bf16_computes_a_transformers_model_in_bf16_with_fp32_master_weights(tmp_path):
    pytest.importorskip("transformers")
    from tests.recipes.test_hf_model import _write_folder

    path = _write_folder(tmp_path / "qwen3", "qwen3")
    for seen, master, loss_dtype in run_on_ranks(2, _dtypes_in_one_step, "bf16", path, timeout=120):
        assert seen["wq"] == ("torch.bfloat16",) * 3 and seen["output"] == ("torch.bfloat16",) * 3
        assert master == ["torch.float32"] and loss_dtype == "torch.float32"
