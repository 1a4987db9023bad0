"""The recipe end to end on a real corpus: a BPE tokenizer trained here, txt/jsonl/parquet text,
prepare_data's token file, evaluation, observability, early stops, every checkpoint key, the
SLURM launch line and the transformers export. Few launches: checks share runs."""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hyper_parallel.checkpoint import CheckpointManager, ModelState, read_checkpoint_metadata
from hyper_parallel.data import prepare_tokens
from hyper_parallel.models.llama import Transformer
from hyper_parallel.platform import free_port
from hyper_parallel.trainer import compose_config, typed_config
from hyper_parallel.trainer.config import llama_config
from hyper_parallel.trainer.loop import build_loader
from hyper_parallel.trainer.step.schedule import warmup_cosine_lr
from tests.recipes.corpus import MODEL_VOCAB, make_corpus
from tests.recipes.script_main import script_main
from tests.recipes.launch import (REPO, TINY, assert_losses_match, env, last_loss_per_step, read_metrics, run,
                                  start, finish, torchrun_cmd)

STEPS = 12


def _ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    _, tokenizer, _ = make_corpus(str(root))
    tokens = str(root / "tokens.bin")
    prepare_tokens([str(root / "text")], tokens, tokenizer=tokenizer, workers=2, docs_per_chunk=5)
    common = [*TINY, f"model.vocab_size={MODEL_VOCAB}", "data.val_fraction=0.15", "eval.every=4",
              "eval.steps=2", "checkpoint.interval=6", "checkpoint.keep_last_n=3"]
    text = ["data=text", f"data.paths={root / 'text'}", f"data.tokenizer={tokenizer}"]
    token_file = ["data=tokens", f"data.path={tokens}", f"data.tokenizer={tokenizer}"]
    return root, tokenizer, common, text, token_file


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """2 ranks on the text corpus, uninterrupted, with eval, a profiler window and TensorBoard."""
    _, _, common, text, _ = corpus
    out = str(tmp_path_factory.mktemp("reference"))
    stdout = _ok(run(torchrun_cmd(2, [*common, *text, f"output_dir={out}", "profiling.enable=true",
                                      "profiling.start_step=2", "profiling.steps=2", "logging.tensorboard=true"],
                                  extra=["--standalone"]), timeout=240))
    return out, stdout


def test_real_corpus_training_logs_eval_throughput_memory_and_traces(reference):
    out, stdout = reference
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    for r in records:
        assert r["tflops"] > 0 and r["mfu"] is None and r["step_time_s"] > 0 and r["memory_bytes"] > 2**20
    evals = {r["step"]: r for r in records if "val_loss" in r}
    assert sorted(evals) == [4, 8, 12]
    assert evals[12]["val_loss"] < evals[4]["val_loss"]
    assert all(r["val_ppl"] == pytest.approx(2.718281828 ** r["val_loss"], rel=1e-6) for r in evals.values())
    assert f"eval step 8: val_loss {evals[8]['val_loss']:.4f}" in stdout and "TFLOP/s" in stdout
    traces = sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "profiles", "*.json")))
    assert traces == ["trace_rank0_steps2-3.json", "trace_rank1_steps2-3.json"]
    assert os.path.getsize(os.path.join(out, "profiles", traces[0])) > 1000
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(out, "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("val_loss")] == [4, 8, 12] and "tflops" in events.Tags()["scalars"]


@pytest.fixture(scope="module")
def stopped_then_resumed(corpus, reference, tmp_path_factory):
    """The prepared token file: stop_after_steps=5 on 2 ranks, then resumed to the end by the
    SLURM script's torchrun line, two 'nodes' x 1 rank on loopback."""
    _, _, common, _, token_file = corpus
    out = str(tmp_path_factory.mktemp("stopped"))
    first = _ok(run(torchrun_cmd(2, [*common, *token_file, f"output_dir={out}", "training.stop_after_steps=5"],
                                 extra=["--standalone"]), timeout=240))
    fake_bin = tmp_path_factory.mktemp("fake_slurm_bin")
    (fake_bin / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")  # the job's first node
    (fake_bin / "srun").write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n')
    for tool in ("scontrol", "srun"):
        os.chmod(fake_bin / tool, 0o755)
    slurm = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "DRY_RUN": "1", "HP_REPO": REPO, "NPROC": "1",
             "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "42",
             "RDZV_PORT": str(free_port()), "TORCHRUN": os.path.join(os.path.dirname(sys.executable), "torchrun"),
             "PYTHON": sys.executable}
    line = subprocess.run(["scripts/slurm/train.sbatch", *common, *token_file, f"output_dir={out}"], cwd=REPO,
                          env={**env(), **slurm}, capture_output=True, text=True, timeout=30)
    assert line.returncode == 0, line.stderr
    command = shlex.split(line.stdout)
    nodes = [start(command) for _ in range(2)]
    outputs = [finish(node, timeout=240) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(outputs)
    return out, first, command, "".join(outputs)


@pytest.mark.slow  # stop/resume: test_e2e.py, test_stop_and_resume.py
def test_stop_after_steps_then_resume_on_prepared_tokens_matches_the_text_run(reference, stopped_then_resumed):
    ref_out, _ = reference
    out, first, command, resumed = stopped_then_resumed
    assert "stop_after_steps: saved a final checkpoint at step 5" in first
    assert "--nnodes=2" in command and "--rdzv_backend=c10d" in command and "--rdzv_id=slurm-42" in command
    assert "resumed from" in resumed and "step-5" in resumed
    # prepare_data wrote exactly the token stream data=text builds: the same losses from step 1.
    assert_losses_match(last_loss_per_step(ref_out), last_loss_per_step(out), range(1, STEPS + 1))
    records = read_metrics(out)
    assert records[4]["lr"] == pytest.approx(read_metrics(ref_out)[4]["lr"], rel=1e-12)  # horizon kept
    ref_val = {r["step"]: r["val_loss"] for r in read_metrics(ref_out) if "val_loss" in r}
    val = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
    assert sorted(val) == [4, 8, 12]
    for step in val:  # evaluation is deterministic and resume-safe
        assert val[step] == pytest.approx(ref_val[step], rel=1e-4)


@pytest.fixture(scope="module")
def one_rank_jobs(corpus, reference, tmp_path_factory):
    """Four 1-rank jobs at once, each on a copy of the reference's checkpoints or a load_from."""
    root, _, common, text, _ = corpus
    ref_out, _ = reference
    base = tmp_path_factory.mktemp("one_rank")

    def copy(name):
        out = base / name
        shutil.copytree(os.path.join(ref_out, "checkpoints"), out / "checkpoints")
        return [f"output_dir={out}"]

    hf_dir = base / "hf"
    assert script_main("export_hf")([os.path.join(ref_out, "checkpoints"), str(hf_dir)]) == 0
    jobs = {
        "load_step_exclude": [*copy("a"), "checkpoint.load_step=6", "checkpoint.exclude=[optim]",
                              "training.stop_after_steps=2"],
        "time_limit": [*copy("b"), "checkpoint.load_step=6", "training.time_limit_minutes=0.0001"],
        "load_only": [f"output_dir={base / 'c'}", f"checkpoint.load_from={ref_out}/checkpoints",
                      "checkpoint.load_only=true", "training.steps=2", "checkpoint.last_save_model_only=true",
                      "checkpoint.export_dtype=bfloat16"],
        "init_from_hf": [f"output_dir={base / 'd'}", f"model.init_from={hf_dir}", "training.steps=1"],
    }
    procs = {name: start([sys.executable, "recipes/train.py", *common, *text, *args]) for name, args in jobs.items()}
    outputs = {name: finish(proc, timeout=240) for name, proc in procs.items()}
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}:\n{outputs[name]}"
    return base, hf_dir, outputs


def _first_batch_loss(corpus, checkpoint_folder):
    """The loss of the reference's final model on the first global batch, in one process."""
    _, _, common, text, _ = corpus
    cfg = typed_config(compose_config([*common, *text]))
    model = Transformer(llama_config(cfg.model))
    assert CheckpointManager(checkpoint_folder).load_latest({"model": ModelState(model)}) == STEPS
    batch = build_loader(cfg.data, cfg.training, cfg.parallel, MODEL_VOCAB, dp_rank=0, dp_size=1).next_batch()
    with torch.no_grad():
        return model, F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).item()


def test_load_step_and_exclude(reference, one_rank_jobs):
    base, _, outputs = one_rank_jobs
    ref = last_loss_per_step(reference[0])
    losses = last_loss_per_step(str(base / "a"))
    assert f"resumed from {base / 'a'}/checkpoints/step-6" in outputs["load_step_exclude"]
    assert sorted(losses) == [7, 8]
    assert_losses_match(ref, losses, [7])  # the step-6 model, not the latest (step 12)
    assert abs(losses[8] - ref[8]) > 1e-3 * ref[8], "the optimizer state was loaded despite exclude"


def test_time_limit_stops_with_a_checkpoint_keeping_the_lr_horizon(reference, one_rank_jobs):
    base, _, outputs = one_rank_jobs
    records = read_metrics(str(base / "b"))
    assert [r["step"] for r in records] == [7]
    assert "time limit: saved a final checkpoint at step 7" in outputs["time_limit"]
    assert os.path.isdir(base / "b" / "checkpoints" / "step-7")
    assert records[0]["lr"] == pytest.approx(warmup_cosine_lr(7, peak_lr=1e-2, warmup_steps=2, total_steps=STEPS,
                                                               min_lr_ratio=0.1), rel=1e-12)
    assert_losses_match(last_loss_per_step(reference[0]), {7: records[0]["loss"]}, [7])


def test_load_only_starts_at_step_zero_and_the_last_save_is_lean(corpus, reference, one_rank_jobs):
    base, _, outputs = one_rank_jobs
    assert "initialised the model from" in outputs["load_only"] and "(model only)" in outputs["load_only"]
    records = read_metrics(str(base / "c"))
    assert [r["step"] for r in records] == [1, 2]
    _, expected = _first_batch_loss(corpus, os.path.join(reference[0], "checkpoints"))
    assert records[0]["loss"] == pytest.approx(expected, rel=1e-5)
    stored = read_checkpoint_metadata(str(base / "c" / "checkpoints" / "step-2")).state_dict_metadata
    assert stored and all(k.startswith("model.") for k in stored)
    assert {md.dtype for md in stored.values()} == {torch.bfloat16}


def test_hf_export_loads_in_transformers_and_back_as_init_from(corpus, reference, one_rank_jobs):
    base, hf_dir, _ = one_rank_jobs
    model, expected = _first_batch_loss(corpus, os.path.join(reference[0], "checkpoints"))
    # model.init_from reads the transformers layout back: the same first loss.
    assert read_metrics(str(base / "d"))[0]["loss"] == pytest.approx(expected, rel=1e-5)
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir))
    tokens = torch.randint(0, MODEL_VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)


def test_bad_corpus_and_tokenizer_exit_with_one_readable_line(corpus, tmp_path):
    """Two jobs at once; the same wrapping covers every ValueError of the data pipeline (the
    other messages are checked in test_corpus_units.py)."""
    root, tokenizer, _, _, _ = corpus
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "no_text.parquet")
    cases = {
        "does not exist": ["data=text", f"data.paths={root / 'text'}", f"data.tokenizer={tmp_path}/tok.json"],
        "no 'text' column": ["data=text", f"data.paths={tmp_path / 'no_text.parquet'}"],
    }
    procs = {m: start([sys.executable, "recipes/train.py", *TINY, f"output_dir={tmp_path}/out", *args],
                      stderr=subprocess.PIPE) for m, args in cases.items()}
    for message, proc in procs.items():
        _, stderr = proc.communicate(timeout=120)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1, stderr
        assert lines[0].startswith("error: data=text: ") and message in lines[0], stderr
