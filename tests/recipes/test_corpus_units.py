"""In-process checks of the data pipeline, evaluation split, throughput formula, HF layout,
operations config and the plot script (no process group)."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch

from hyper_parallel.data import (HFTokenizer, build_source, iter_documents, load_tokenizer, prepare_tokens,
                                 read_text_tokens, split_windows)
from hyper_parallel.models import hf_llama
from hyper_parallel.models.llama import LlamaConfig, Transformer, apply_rope, rope_tables
from hyper_parallel.trainer import ConfigError, compose_config, validate_config
from hyper_parallel.trainer.observability.performance import flops_per_token, matmul_params
from hyper_parallel.trainer.checkpointing.operations import StopRule
from tests.recipes.corpus import MODEL_VOCAB, VOCAB, make_corpus
from tests.recipes.script_main import script_main

@pytest.fixture(scope="module")
def docs_corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs, tokenizer, _ = make_corpus(str(root))
    return root, docs, tokenizer


def test_documents_come_back_in_order_from_txt_jsonl_and_parquet(docs_corpus):
    root, docs, _ = docs_corpus
    assert list(iter_documents(str(root / "text"))) == docs


def test_bpe_tokenizer_joins_documents_with_eos(docs_corpus):
    root, docs, path = docs_corpus
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == VOCAB and tok.eos_id == 0
    tokens = read_text_tokens(str(root / "text"), tok)
    expected = np.concatenate([x for d in docs for x in (tok.encode(d), [0])][:-1])
    np.testing.assert_array_equal(tokens, expected)
    assert tok.decode(tokens[: len(tok.encode(docs[0]))]) == docs[0]


@pytest.mark.parametrize("workers", [1, 2])
def test_prepare_data_matches_in_memory_tokenization_and_sidecar_is_checked(docs_corpus, tmp_path, workers):
    root, _, path = docs_corpus
    out = str(tmp_path / "tokens.bin")
    meta = prepare_tokens([str(root / "text")], out, tokenizer=path, workers=workers, docs_per_chunk=4)
    expected = read_text_tokens(str(root / "text"), load_tokenizer(path))
    assert meta["dtype"] == "uint16" and meta["num_tokens"] == len(expected) and meta["vocab_size"] == VOCAB
    assert meta["num_documents"] == 36 and json.load(open(out + ".json")) == meta
    np.testing.assert_array_equal(np.fromfile(out, dtype=np.uint16), expected)
    source = build_source("tokens", seq_len=16, vocab_size=MODEL_VOCAB, seed=0, path=out, dtype="uint16",
                          tokenizer=path)
    assert source.samples([1]).tolist()[0] == expected[16:33].tolist()
    with pytest.raises(ValueError, match="holds uint16 ids, but data.dtype=uint32"):
        build_source("tokens", seq_len=16, vocab_size=MODEL_VOCAB, seed=0, path=out, dtype="uint32")
    with pytest.raises(ValueError, match="tokenized with vocab_size=300, more than model.vocab_size=256"):
        build_source("tokens", seq_len=16, vocab_size=256, seed=0, path=out, dtype="uint16")
    with pytest.raises(ValueError, match="not data.tokenizer=bytes"):
        build_source("tokens", seq_len=16, vocab_size=MODEL_VOCAB, seed=0, path=out, dtype="uint16", tokenizer="bytes")
    with open(out, "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ValueError, match="truncated or overwritten"):
        build_source("tokens", seq_len=16, vocab_size=MODEL_VOCAB, seed=0, path=out, dtype="uint16")


def test_prepare_data_script_and_its_bad_inputs(docs_corpus, tmp_path, capsys):
    root, _, path = docs_corpus
    main = script_main("prepare_data")
    assert main([str(root / "text"), "--output", str(tmp_path / "b.bin"), "--quiet", "--workers", "1"]) == 0
    assert json.load(open(tmp_path / "b.bin.json"))["tokenizer"] == "bytes"
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "e.txt").write_text("")
    bad_parquet = tmp_path / "bad.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["x"]}), bad_parquet)
    cases = {
        "no end-of-document token": [str(root / "text"), "--tokenizer", path, "--eos-token", "<nope>"],
        "tokenizer file": [str(root / "text"), "--tokenizer", str(tmp_path / "missing.json")],
        "no 'text' column": [str(bad_parquet)],
        "holds no text": [str(tmp_path / "empty")],
    }
    for message, args in cases.items():
        capsys.readouterr()
        assert main([*args, "--output", str(tmp_path / "x.bin"), "--quiet"]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and "\n" not in err, err
    assert not os.path.exists(tmp_path / "x.bin")


def test_tokenizer_larger_than_the_model_and_an_empty_corpus_are_refused(docs_corpus, tmp_path):
    root, _, path = docs_corpus
    with pytest.raises(ValueError, match="has ids up to 299, which need vocab_size=300, more than model.vocab_size=256; raise model.vocab_size"):
        build_source("text", seq_len=8, vocab_size=256, seed=0, paths=str(root / "text"), tokenizer=path)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no text"):
        build_source("text", seq_len=8, vocab_size=MODEL_VOCAB, seed=0, paths=str(tmp_path / "empty.jsonl"),
                     tokenizer=path)


def test_val_fraction_holds_out_the_last_samples():
    from hyper_parallel.data import TokenWindows

    source = TokenWindows(np.arange(101), seq_len=10, vocab_size=200)
    train, val = split_windows(source, 0.2)
    assert (train.num_samples, val.num_samples) == (8, 2)
    assert train.samples([7]).tolist()[0][-1] == 80 and val.samples([0]).tolist()[0][0] == 80
    with pytest.raises(ValueError, match="cannot be split"):
        split_windows(TokenWindows(np.arange(11), seq_len=10, vocab_size=200), 0.5)


def test_flops_per_token_counts_every_matmul():
    cfg = LlamaConfig(vocab_size=320, dim=32, n_layers=2, n_heads=4, n_kv_heads=2)
    model = Transformer(cfg)
    by_hand = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "tok_embeddings" not in n)
    assert matmul_params(cfg) == by_hand
    assert flops_per_token(cfg, 64) == 6 * by_hand + 12 * 2 * 32 * 64


def test_hf_rotary_permutation_is_the_transformers_rotate_half():
    """q rotated by our interleaved RoPE, then permuted, equals the permuted q rotated by halves
    (transformers' rotate_half with cat(freqs, freqs)), so attention scores are unchanged."""
    torch.manual_seed(0)
    heads, head_dim, seq, dim = 2, 8, 5, 16
    w = torch.randn(heads * head_dim, dim, dtype=torch.float64)
    x = torch.randn(seq, dim, dtype=torch.float64)
    cos, sin = rope_tables(head_dim, seq, 10000.0)
    q_ours = apply_rope((x @ w.T).view(seq, heads, head_dim).transpose(0, 1).unsqueeze(0), cos.double(), sin.double())
    w_hf = hf_llama.interleaved_to_halves(w, heads)
    q = (x @ w_hf.T).view(seq, heads, head_dim).transpose(0, 1)
    c, s = torch.cat([cos, cos], -1).double(), torch.cat([sin, sin], -1).double()
    rotate_half = torch.cat([-q[..., head_dim // 2:], q[..., : head_dim // 2]], -1)
    q_hf = q * c + rotate_half * s
    perm = hf_llama.interleaved_to_halves(torch.arange(head_dim * heads)[:, None], heads).flatten()
    torch.testing.assert_close(q_hf, q_ours[0].transpose(0, 1).reshape(seq, -1)[:, perm].view(seq, heads, head_dim)
                               .transpose(0, 1), rtol=1e-5, atol=1e-5)  # apply_rope computes in fp32
    torch.testing.assert_close(hf_llama.halves_to_interleaved(w_hf, heads), w, rtol=0, atol=0)


def test_hf_names_and_config_follow_transformers_llama():
    cfg = LlamaConfig(vocab_size=320, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, tie_embeddings=True)
    names = {hf_llama.hf_name(k) for k in Transformer(cfg).state_dict()}
    assert "model.layers.1.self_attn.k_proj.weight" in names and "model.layers.0.mlp.down_proj.weight" in names
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    assert hf_llama.to_hf("output.weight", torch.zeros(1), cfg) is None  # tied: transformers ties it
    config = hf_llama.hf_config(cfg, torch.bfloat16)
    assert config["model_type"] == "llama" and config["num_key_value_heads"] == 2
    assert config["intermediate_size"] == cfg.ffn_hidden_dim and config["dtype"] == config["torch_dtype"] == "bfloat16"


def test_new_keys_are_validated():
    cfg = compose_config(["training.stop_after_steps=0", "training.time_limit_minutes=-1", "eval.every=-2",
                          "checkpoint.load_only=true", "checkpoint.exclude=[model]", "checkpoint.export_dtype=int8",
                          "profiling.steps=0"])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, 1)
    for text in ("training.stop_after_steps=0", "training.time_limit_minutes=-1", "eval.every=-2",
                 "load_only=true needs checkpoint.load_from", "checkpoint.exclude=['model']",
                 "export_dtype='int8'", "profiling.steps=0"):
        assert text in str(err.value), text


def test_stop_rule():
    rule = StopRule(start_step=4, stop_after_steps=3, time_limit_minutes=None)
    assert [rule.steps_done(s) for s in (5, 6, 7)] == [False, False, True]
    assert not rule.out_of_time(100.0)
    timed = StopRule(start_step=0, stop_after_steps=None, time_limit_minutes=1.0)
    assert not timed.out_of_time(1.0) and timed.out_of_time(61.0)


def test_plot_script_draws_train_and_validation_runs(tmp_path):
    for name, shift in (("a", 0.0), ("b", 0.1)):
        (tmp_path / name).mkdir()
        with open(tmp_path / name / "metrics.jsonl", "w") as f:
            for step in range(1, 11):
                record = {"step": step, "loss": 5 - step * 0.3 + shift, "lr": 1e-3, "tokens_per_s": 1000.0,
                          "tflops": 0.5, "memory_bytes": 2**30}
                if step % 5 == 0:
                    record["val_loss"] = 5 - step * 0.25
                f.write(json.dumps(record) + "\n")
    out = tmp_path / "plot.png"
    assert script_main("plot_metrics")([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out),
                                         "--width", "6", "--height", "4", "--dpi", "50"]) == 0
    header = out.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", header[16:24]) == (300, 200)
