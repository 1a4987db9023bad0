"""transformers' Qwen3-MoE directories into the MoE model and back (hyper_parallel.models.hf_moe):
the same logits both ways, sharded loads, and the refusals."""

import json
import re

import pytest
import torch
from safetensors import safe_open

import hyper_parallel as hp
from hyper_parallel.checkpoint import export_hf, save
from hyper_parallel.models import hf_moe
from hyper_parallel.models.hf_llama import read_config
from hyper_parallel.models.moe import MoEConfig, MoETransformer
from tests.fully_shard._helpers import shard_layers_and_root
from tests.multirank import run_on_ranks

transformers = pytest.importorskip("transformers")

# head_dim 16 with dim 32 and 4 heads (q projects to 64), a dense first layer, GQA.
HF = dict(vocab_size=61, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=3,
          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
          norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=32, rope_theta=10000.0)


def _hf_dir(path, **changes):
    """A random Qwen3MoeForCausalLM saved with save_pretrained; every weight (norms too) far from
    its default so that a permutation or a name mix-up shows in the logits."""
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**HF, **changes}))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape) * (0.3 if param.ndim > 1 else 1.0))
    model.save_pretrained(path)
    return model.eval()


def _tokens():
    return torch.randint(0, 61, (2, 32), generator=torch.Generator().manual_seed(1))


def _loaded(path) -> MoETransformer:
    model = MoETransformer(hf_moe.moe_config(read_config(str(path))))
    model.init_weights(seed=5)
    hf_moe.load_pretrained(model, str(path), model.cfg)
    return model


def test_a_transformers_directory_loads_with_the_same_logits(tmp_path):
    hf = _hf_dir(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "model.layers.1.mlp.experts.7.down_proj.weight" in f.keys()  # per-expert on disk
    ours = _loaded(tmp_path)
    assert ours.cfg.first_k_dense == 1 and ours.cfg.head_dim == 16
    with torch.no_grad():
        expected, actual = hf(_tokens()).logits, ours(_tokens())
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_an_export_loads_into_transformers_with_the_same_logits(tmp_path):
    cfg = MoEConfig(vocab_size=61, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, num_experts=8,
                    top_k=3, moe_ffn_dim=24, norm_topk_prob=False, first_k_dense=1, ffn_hidden_dim=40,
                    max_seq_len=32, aux_loss_weight=0.01)
    ours = MoETransformer(cfg)
    ours.init_weights(seed=2)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn(param.shape))
    save({"model": ours.state_dict()}, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    index = export_hf(tmp_path / "step-1", tmp_path / "hf", convert=lambda n, t: hf_moe.to_hf(n, t, cfg))
    assert "model.layers.2.mlp.experts.7.gate_proj.weight" in index["weight_map"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_moe.hf_config(cfg, torch.float32)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    with torch.no_grad():
        expected, actual = ours(_tokens()), hf(_tokens()).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert hf_moe.moe_config(read_config(str(tmp_path / "hf")), aux_loss_weight=0.01) == cfg  # and back


def _sharded_load(path):
    mesh = hp.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    cfg = hf_moe.moe_config(read_config(path))
    with torch.device("meta"):
        model = MoETransformer(cfg)
    shard_layers_and_root(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights(seed=5)
    hf_moe.load_pretrained(model, path, cfg)
    w1 = model.layers["1"].moe.experts.w1
    return {name: p.full_tensor().detach() for name, p in model.named_parameters()}, w1.to_local().shape[0]


def test_a_sharded_model_loads_each_ranks_experts(tmp_path):
    _hf_dir(tmp_path)
    expected = dict(_loaded(tmp_path).named_parameters())
    for full, local_experts in run_on_ranks(2, _sharded_load, str(tmp_path)):
        assert local_experts == 4  # Shard(0): each rank holds (and reads) 4 of the 8 experts
        for name, value in full.items():
            assert torch.equal(value, expected[name].detach()), name


def test_a_directory_of_another_shape_or_an_unsupported_model_is_refused(tmp_path):
    _hf_dir(tmp_path)
    cfg = hf_moe.moe_config(read_config(str(tmp_path)))
    other = MoEConfig(**{**cfg.__dict__, "n_heads": 2, "n_kv_heads": 1, "head_dim": 32})
    with pytest.raises(ValueError, match=re.escape("does not describe this model: n_heads 4 vs model.n_heads=2; "
                                                   "n_kv_heads 2 vs model.n_kv_heads=1; head_dim 16 vs")):
        hf_moe.load_pretrained(MoETransformer(other), str(tmp_path), other)
    shared = MoEConfig(**{**cfg.__dict__, "shared_experts": 1})
    with pytest.raises(ValueError, match="Qwen3-MoE has no equivalent of shared_experts=1"):
        hf_moe.hf_config(shared, torch.float32)
    with pytest.raises(ValueError, match="dense layers \\[1\\] are not the first ones"):
        hf_moe.moe_config({**read_config(str(tmp_path)), "mlp_only_layers": [1]})
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = [k for k in f.keys() if k != "model.layers.2.mlp.experts.5.up_proj.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(
        keys, "model.safetensors")}))
    with pytest.raises(KeyError, match=re.escape("does not hold ['model.layers.2.mlp.experts.5.up_proj.weight']")):
        hf_moe.load_pretrained(MoETransformer(cfg), str(tmp_path), cfg)


def test_hf_config_names_float64_and_refuses_what_configs_cannot_name():
    from hyper_parallel.models.moe import MOE_CONFIGS

    cfg = MoEConfig(**MOE_CONFIGS["moe_debug"])
    assert hf_moe.hf_config(cfg, torch.float64)["dtype"] == "float64"  # transformers 5 reads dtype
    with pytest.raises(ValueError, match="cannot export weights of dtype torch.int32"):
        hf_moe.hf_config(cfg, torch.int32)
