"""model.init_from checks the directory's config.json against the model (in-process, no ranks)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from hyper_parallel.models import hf_llama
from hyper_parallel.models.llama import Transformer
from hyper_parallel.trainer import compose_config
from hyper_parallel.trainer.config import ConfigError, llama_config
from hyper_parallel.trainer.parallelize import build_model
from tests.recipes.launch import TINY

# Same tensor shapes as TINY's 4 heads / 2 kv heads (dim 32), other head counts.
EIGHT_HEADS = ["model.n_heads=8", "model.n_kv_heads=4"]


def _export(folder, overrides, *, layout):
    """A plain model of ``overrides`` written to ``folder`` in ``layout``, with its config.json."""
    cfg = llama_config(compose_config([*TINY, *overrides]).model)
    model = Transformer(cfg)
    model.init_weights(seed=3)
    folder.mkdir()
    if layout is hf_llama.Layout.TRANSFORMERS:
        tensors = dict(item for item in (hf_llama.to_hf(k, v, cfg) for k, v in model.state_dict().items()) if item)
        config = hf_llama.hf_config(cfg, torch.float32)
    else:
        tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
        config = {"architectures": [hf_llama.NATIVE_ARCHITECTURE], **dataclasses.asdict(cfg)}
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return model


def _build(overrides):
    cfg = compose_config([*TINY, *overrides])
    return build_model(cfg.model, mesh=None, device=torch.device("cpu"), seed=0)


@pytest.mark.parametrize("layout", list(hf_llama.Layout))
def test_init_from_loads_an_export_of_the_same_model(tmp_path, layout):
    source = _export(tmp_path / "hf", [], layout=layout)
    loaded = _build([f"model.init_from={tmp_path / 'hf'}"])
    for (name, expected), actual in zip(source.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("layout", list(hf_llama.Layout))
def test_init_from_refuses_an_export_of_other_head_counts_with_the_same_shapes(tmp_path, layout):
    _export(tmp_path / "hf", [], layout=layout)
    with pytest.raises(ConfigError) as err:
        _build([f"model.init_from={tmp_path / 'hf'}", *EIGHT_HEADS])
    message = str(err.value)
    assert "\n" not in message and f"{tmp_path / 'hf' / 'config.json'} does not describe this model" in message
    if layout is hf_llama.Layout.TRANSFORMERS:
        assert "num_attention_heads 4 vs model.n_heads=8; num_key_value_heads 2 vs model.n_kv_heads=4" in message
    else:
        assert "n_heads 4 vs model.n_heads=8; n_kv_heads 2 vs model.n_kv_heads=4" in message


def test_init_from_names_every_differing_field(tmp_path):
    _export(tmp_path / "hf", ["model.rope_theta=500000", "model.tie_embeddings=true"],
            layout=hf_llama.Layout.TRANSFORMERS)
    with pytest.raises(ConfigError, match=r"rope_theta 500000(\.0)? vs model\.rope_theta=10000\.0; "
                                          r"tie_word_embeddings True vs model\.tie_embeddings=False"):
        _build([f"model.init_from={tmp_path / 'hf'}"])


@pytest.mark.parametrize("text, problem", [("{not json", "is not valid JSON"), ("[1, 2]", "holds a JSON list"),
                                           ('{"model_type": "gpt2"}', "describes neither a transformers Llama")])
def test_an_unreadable_or_foreign_config_json_is_an_error_naming_it(tmp_path, text, problem):
    _export(tmp_path / "hf", [], layout=hf_llama.Layout.TRANSFORMERS)
    (tmp_path / "hf" / "config.json").write_text(text)
    with pytest.raises(ConfigError, match=f"{tmp_path / 'hf' / 'config.json'} {problem}"):
        _build([f"model.init_from={tmp_path / 'hf'}"])
