"""Hugging Face interop in-process (no ranks): model.init_from checks the directory's config.json
against the model; scripts/export_hf.py puts the run's tokenizer next to the model."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from hyper_parallel.checkpoint import save
from hyper_parallel.data import prepare_tokens
from hyper_parallel.models import hf_llama
from hyper_parallel.models.llama import LlamaConfig, RopeScaling, Transformer
from hyper_parallel.trainer import compose_config
from hyper_parallel.trainer.config import typed_config
from hyper_parallel.trainer.config import ConfigError, llama_config
from hyper_parallel.trainer.setup.parallelize import build_model
from tests.recipes.corpus import MODEL_VOCAB, make_corpus
from tests.recipes.launch import TINY
from tests.recipes.script_main import script_main

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


SCALED = ["model.rope_scaling={factor:8.0,low_freq_factor:1.0,high_freq_factor:4.0,"
          "original_max_position_embeddings:32}"]


@pytest.mark.parametrize("layout", list(hf_llama.Layout))
def test_rope_scaling_round_trips_through_config_json(tmp_path, layout):
    source = _export(tmp_path / "hf", SCALED, layout=layout)
    config = hf_llama.read_config(str(tmp_path / "hf"))
    if layout is hf_llama.Layout.TRANSFORMERS:
        assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        assert hf_llama.hf_rope_scaling(config) == source.cfg.rope_scaling
        transformers = pytest.importorskip("transformers")
        read = transformers.LlamaConfig.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
        assert {**read.rope_parameters, "rope_theta": None} == {**config["rope_scaling"], "rope_theta": None}
    else:
        assert LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}) == source.cfg
    loaded = _build([f"model.init_from={tmp_path / 'hf'}", *SCALED])
    assert loaded.cfg.rope_scaling == source.cfg.rope_scaling
    for (name, expected), actual in zip(source.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=name)
    with pytest.raises(ConfigError, match=r"rope_scaling RopeScaling\(factor=8\.0, .*"
                                          r"original_max_position_embeddings=32\) vs model\.rope_scaling=None"):
        _build([f"model.init_from={tmp_path / 'hf'}"])  # a model without the scaling is refused


LLAMA_3_1 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("config, expected", [
    ({"rope_scaling": {**LLAMA_3_1, "rope_type": "llama3"}, "rope_theta": 500000.0}, RopeScaling()),  # Llama 3.1's own
    ({"rope_scaling": {**LLAMA_3_1, "type": "llama3"}}, RopeScaling()),  # the older key
    ({"rope_parameters": {**LLAMA_3_1, "rope_type": "llama3", "rope_theta": 5e5}}, RopeScaling()),  # transformers 5
    ({"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
      "max_position_embeddings": 2048}, RopeScaling(factor=32.0, original_max_position_embeddings=2048)),
    ({"rope_scaling": None, "rope_theta": 500000.0}, None),  # Llama 3
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, None),
])
def test_transformers_rope_scaling_entries_are_read_as_transformers_reads_them(config, expected):
    assert hf_llama.hf_rope_scaling(config) == expected


def test_an_unsupported_rope_type_is_an_error_naming_the_file(tmp_path):
    _export(tmp_path / "hf", [], layout=hf_llama.Layout.TRANSFORMERS)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"{tmp_path / 'hf' / 'config.json'}: rope_type 'yarn' is not supported"):
        _build([f"model.init_from={tmp_path / 'hf'}"])


def _run_folder(root, data):
    """A run's output folder: config.yaml with ``data`` and a model checkpoint at step 1."""
    cfg = compose_config([*TINY, f"model.vocab_size={MODEL_VOCAB}", f"output_dir={root}/run", *data])
    os.makedirs(f"{root}/run")
    OmegaConf.save(cfg, f"{root}/run/config.yaml")
    model = Transformer(llama_config(cfg.model))
    model.init_weights(seed=0)
    save({"model": model.state_dict()}, checkpoint_id=f"{root}/run/checkpoints/step-1", no_dist=True)
    return f"{root}/run/checkpoints"


@pytest.mark.parametrize("kind", ["text", "tokens"])
def test_the_export_carries_the_runs_tokenizer(tmp_path, monkeypatch, capsys, kind):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    (tmp_path / "corpus").mkdir()
    docs, tokenizer, _ = make_corpus(str(tmp_path / "corpus"))
    if kind == "text":  # data.tokenizer names it
        data = ["data=text", f"data.paths={tmp_path / 'corpus' / 'text'}", f"data.tokenizer={tokenizer}"]
    else:  # a token file without data.tokenizer: its sidecar names it
        prepare_tokens([str(tmp_path / "corpus" / "text")], str(tmp_path / "tokens.bin"), tokenizer=tokenizer)
        data = ["data=tokens", f"data.path={tmp_path / 'tokens.bin'}"]
    out = tmp_path / "hf"
    assert script_main("export_hf")([_run_folder(tmp_path, data), str(out)]) == 0
    assert f"and the tokenizer {tokenizer}" in capsys.readouterr().out
    loaded = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(tokenizer)
    eos_id = reference.token_to_id("<|endoftext|>")
    assert loaded.eos_token == loaded.bos_token == "<|endoftext|>" and loaded.eos_token_id == eos_id
    assert loaded(docs[0], add_special_tokens=False)["input_ids"] == reference.encode(docs[0]).ids
    config = transformers.AutoConfig.from_pretrained(str(out), local_files_only=True)
    assert config.eos_token_id == config.bos_token_id == eos_id


def test_a_byte_level_run_exports_no_tokenizer(tmp_path):
    corpus = tmp_path / "doc.txt"
    corpus.write_text("some text " * 200)
    out = tmp_path / "hf"
    assert script_main("export_hf")([_run_folder(tmp_path, ["data=text", f"data.paths={corpus}"]), str(out)]) == 0
    assert not (out / "tokenizer.json").exists()
    assert "eos_token_id" not in json.loads((out / "config.json").read_text())


def test_the_export_replaces_planted_symlinks_instead_of_writing_through_them(tmp_path):
    (tmp_path / "corpus").mkdir()
    _, tokenizer, _ = make_corpus(str(tmp_path / "corpus"))
    data = ["data=text", f"data.paths={tmp_path / 'corpus' / 'text'}", f"data.tokenizer={tokenizer}"]
    out = tmp_path / "hf"
    out.mkdir()
    victims = {}
    for name in ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"):
        victims[name] = tmp_path / f"victim-{name}"
        victims[name].write_text("precious")
        os.symlink(victims[name], out / name)
    assert script_main("export_hf")([_run_folder(tmp_path, data), str(out)]) == 0
    for name, victim in victims.items():
        assert victim.read_text() == "precious", name
        assert not os.path.islink(out / name) and (out / name).stat().st_size > 0, name


# A mixture of experts (model=moe_debug) in transformers' Qwen3-MoE layout: export and init_from.
MOE = ["model=moe_debug", "training.seq_len=32", "training.global_batch_size=8", "optim.lr=1e-2",
       "optim.warmup_steps=1", "logging.log_every=1", "checkpoint.interval=100"]


def _moe_run_folder(root, dtype):
    """A run's output folder of ``model=moe_debug``: config.yaml and a ``dtype`` checkpoint at step 1."""
    from hyper_parallel.models.moe import MoETransformer
    from hyper_parallel.trainer.config.model import model_config

    cfg = compose_config([*MOE, f"output_dir={root}/run"])
    os.makedirs(f"{root}/run")
    OmegaConf.save(cfg, f"{root}/run/config.yaml")
    model = MoETransformer(model_config(typed_config(cfg).model))
    model.init_weights(seed=4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # far from 1, so that a permuted q/k norm shows in the logits
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name))))
    save({"model": {k: v.to(dtype) for k, v in model.state_dict().items()}},
         checkpoint_id=f"{root}/run/checkpoints/step-1", no_dist=True)
    return model.to(dtype).eval(), f"{root}/run/checkpoints"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_moe_run_exports_to_transformers_qwen3_moe_with_the_same_logits(tmp_path, dtype):
    transformers = pytest.importorskip("transformers")
    ours, checkpoints = _moe_run_folder(tmp_path, dtype)
    out = tmp_path / "hf"
    assert script_main("export_hf")([checkpoints, str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    assert config["model_type"] == "qwen3_moe" and config["dtype"] == config["torch_dtype"] == name
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and {p.dtype for p in hf.parameters()} == {dtype}
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, actual = ours(tokens).float(), hf(tokens).logits.float()
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2  # bf16: both round each matmul's output
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance)


def test_an_moe_export_refuses_what_qwen3_moe_cannot_hold_and_the_native_format(tmp_path, capsys):
    _, checkpoints = _moe_run_folder(tmp_path, torch.float32)
    assert script_main("export_hf")([checkpoints, str(tmp_path / "native"), "--format", "native"]) == 1
    assert "--format native covers the Llama model only" in capsys.readouterr().err
    config = OmegaConf.load(tmp_path / "run" / "config.yaml")
    config.model.moe.shared_experts = 1
    OmegaConf.save(config, tmp_path / "shared.yaml")
    assert script_main("export_hf")([checkpoints, str(tmp_path / "hf"), "--config", str(tmp_path / "shared.yaml")]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "error: transformers' Qwen3-MoE has no equivalent of shared_experts=1", err
    assert not (tmp_path / "hf").exists()
