"""The reference Llama model: shapes, tying, mesh-independent initialisation, and Llama 3.1's
RoPE scaling against ``transformers``."""

import math
import re

import pytest
import torch

import hyper_parallel as hp
from hyper_parallel.models import build_llama, hf_llama
from hyper_parallel.models.llama import LlamaConfig, RopeScaling, Transformer, rope_tables
from tests.fully_shard._helpers import shard_layers_and_root
from tests.multirank import run_on_ranks

TINY = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=61, max_seq_len=16)


def test_forward_shape_and_tied_embeddings_survive_to_empty():
    with torch.device("meta"):
        model = build_llama("llama_debug", tie_embeddings=True, **TINY)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    assert model.output.weight is model.tok_embeddings.weight
    logits = model(torch.randint(0, 61, (2, 16)))
    assert logits.shape == (2, 16, 61) and torch.isfinite(logits).all()


def test_the_seed_changes_every_initialised_parameter():
    """Seeds 3 and 3 + 2**32 (which torch's generator alone could not tell apart) and 4 give
    three different models; the same seed gives the same one."""
    def init(seed):
        model = build_llama("llama_debug", **TINY)
        model.init_weights(seed=seed)
        return {name: p.detach().clone() for name, p in model.named_parameters() if p.std() > 0}

    base = init(3)
    assert all(torch.equal(base[n], p) for n, p in init(3).items())
    for other in (init(4), init(3 + 2**32)):
        assert all(not torch.equal(base[n], p) for n, p in other.items())


def _sharded_init_full_params(mesh_shape):
    mesh = hp.init_device_mesh("cpu", mesh_shape)
    with torch.device("meta"):
        model = build_llama("llama_debug", **TINY)
    shard_layers_and_root(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    return {name: p.full_tensor().detach() for name, p in model.named_parameters()}


def test_init_is_the_same_on_every_mesh():
    reference = build_llama("llama_debug", **TINY)
    reference.init_weights(seed=3)
    expected = dict(reference.named_parameters())
    for world, mesh_shape in ((2, (2,)), (4, (4,)), (4, (2, 2))):
        full = run_on_ranks(world, _sharded_init_full_params, mesh_shape)[0]
        assert full.keys() == expected.keys()
        for name, value in full.items():
            assert torch.equal(value, expected[name].detach()), (mesh_shape, name)


# Llama 3.1's scaling with a short original context, so a 128-token sequence reaches past it.
SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)


def _sharp_model(scaling):
    """A tiny model whose attention is sharp enough for RoPE to matter to the logits."""
    cfg = LlamaConfig(vocab_size=61, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128,
                      rope_scaling=scaling)
    model = Transformer(cfg)
    model.init_weights(seed=3)
    with torch.no_grad():
        for layer in model.layers.values():
            layer.attention.wq.weight.mul_(20)
            layer.attention.wk.weight.mul_(20)
    return cfg, model


def test_llama3_rope_scaling_gives_the_logits_of_transformers_llama():
    transformers = pytest.importorskip("transformers")
    cfg, ours = _sharp_model(SCALING)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_llama.hf_config(cfg, torch.float32)))
    converted = (hf_llama.to_hf(name, tensor, cfg) for name, tensor in ours.state_dict().items())
    hf.load_state_dict(dict(item for item in converted if item))
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, actual, unscaled = hf(tokens).logits, ours(tokens), _sharp_model(None)[1](tokens)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    # The case is one scaling shows in: plain RoPE is far off, past the original context most.
    assert (unscaled - expected)[:, SCALING.original_max_position_embeddings:].abs().max() > 1e-2


def test_llama3_rope_scaling_keeps_high_and_stretches_low_frequencies():
    def frequencies(scaling):  # the angles at position 1
        cos, sin = rope_tables(16, 2, 10000.0, scaling=scaling)
        return torch.atan2(sin[1], cos[1])

    inv_freq, scaled = frequencies(None), frequencies(SCALING)
    wavelen = 2 * math.pi / inv_freq
    high, low = wavelen < 32 / 4, wavelen > 32 / 1
    assert high.any() and low.any() and (~high & ~low).any()
    torch.testing.assert_close(scaled[high], inv_freq[high])
    torch.testing.assert_close(scaled[low], inv_freq[low] / 8)
    between = ~high & ~low
    assert ((scaled[between] < inv_freq[between]) & (scaled[between] > inv_freq[between] / 8)).all()


@pytest.mark.parametrize("scaling, problem", [
    (dict(factor=0.5), "rope_scaling.factor=0.5 must be >= 1"),
    (dict(low_freq_factor=4.0, high_freq_factor=1.0), "rope_scaling.low_freq_factor=4.0 must be below"),
    (dict(original_max_position_embeddings=0), "original_max_position_embeddings=0 must be a positive integer"),
    (dict(factor="8"), "rope_scaling.factor='8' must be a finite number > 0"),
    (dict(rope_type="llama3"), "rope_scaling has unknown key(s) rope_type"),
])
def test_bad_rope_scaling_is_refused_in_one_line(scaling, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        LlamaConfig(rope_scaling=scaling)


def test_a_mapping_becomes_rope_scaling_and_build_llama_1b_has_llama_3_2s():
    assert LlamaConfig(rope_scaling={"factor": 32.0}).rope_scaling == RopeScaling(factor=32.0)
    with torch.device("meta"):
        assert build_llama("llama_1b").cfg.rope_scaling == RopeScaling(factor=32.0)


def test_the_llama_stage_split_keeps_the_model_names():
    from hyper_parallel.models import llama_parallel

    stage = llama_parallel.split_stage(build_llama("llama_debug", **TINY), range(1, 2), first=False, last=True)
    assert list(stage.layers) == ["1"] and stage.tok_embeddings is None and stage.output is not None
