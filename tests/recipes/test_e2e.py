"""The recipe end to end under torchrun on CPU: learning, resume on other meshes, faults, data,
multi-node, HF export. Runs share one uninterrupted 2-rank reference run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from hyper_parallel.checkpoint import LOCK_FILE, CheckpointManager, ModelState, is_checkpoint
from hyper_parallel.models.llama import LlamaConfig, Transformer
from hyper_parallel.platform import free_port
from hyper_parallel.trainer import compose_config, typed_config
from hyper_parallel.trainer.loop import build_loader
from hyper_parallel.trainer.config import llama_config
from tests.recipes.launch import (TINY, assert_losses_match, finish, last_loss_per_step,
                                  read_metrics, run, start, torchrun_cmd, wait_for_step, worker_pids)

STEPS = 12


def _ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def _copy_checkpoint(src_folder: str, step: int, dst_output: str) -> list[str]:
    """A new output dir whose checkpoint folder holds only ``step`` of ``src_folder``."""
    folder = os.path.join(dst_output, "checkpoints")
    shutil.copytree(os.path.join(src_folder, f"step-{step}"), os.path.join(folder, f"step-{step}"))
    return [f"output_dir={dst_output}"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """2-rank FSDP, uninterrupted, async checkpoints at steps 6 and 12."""
    out = str(tmp_path_factory.mktemp("reference"))
    stdout = _ok(run(torchrun_cmd(2, [*TINY, f"output_dir={out}", "checkpoint.interval=6",
                                      "checkpoint.keep_last_n=3", "checkpoint.async_save=true"],
                                  extra=["--standalone"])))
    return out, stdout


def test_loss_goes_down_with_progress_metrics_and_summary(reference):
    out, stdout = reference
    records = read_metrics(out)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for key in ("loss", "lr", "tokens_per_s", "grad_norm", "loss_floor"):
        assert all(isinstance(r[key], float) for r in records), key
    floor = records[0]["loss_floor"]
    assert sum(r["loss"] for r in records[-3:]) / 3 < records[0]["loss"] - 0.7
    assert records[-1]["loss"] > floor
    assert records[1]["lr"] == pytest.approx(1e-2) and records[-1]["lr"] == pytest.approx(1e-3)
    assert f"step {STEPS}/{STEPS}" in stdout and "tok/s" in stdout and "eta" in stdout
    assert "mesh 2 (shard)" in stdout and f"floor {floor:.4f}" in stdout
    assert "done: steps 0 -> 12" in stdout
    folder = os.path.join(out, "checkpoints")
    assert sorted(set(os.listdir(folder)) - {LOCK_FILE}) == ["step-12", "step-6"]


@pytest.mark.slow  # HSDP resume: in-process in test_nd_resume.py
def test_resume_on_hsdp_2x2_over_two_nodes_matches(reference, tmp_path):
    """Two torchrun agents ("nodes") x 2 ranks on loopback, c10d rendezvous, via scripts/train.sh."""
    ref_out, _ = reference
    overrides = [*TINY, *_copy_checkpoint(os.path.join(ref_out, "checkpoints"), 6, str(tmp_path)),
                 "parallel=hsdp", "checkpoint.interval=100"]
    env = {"NNODES": "2", "NPROC": "2", "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
           "RDZV_ID": "e2e", "TORCHRUN": f"{os.path.dirname(sys.executable)}/torchrun", "PYTHON": sys.executable}
    nodes = [start(["env", *(f"{k}={v}" for k, v in env.items()), "scripts/train.sh", *overrides])
             for _ in range(2)]
    outputs = [finish(node, timeout=150) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), "\n".join(outputs)
    assert "mesh 2x2 (replicate, shard)" in "".join(outputs)
    assert "resumed from" in "".join(outputs)
    resumed = last_loss_per_step(str(tmp_path))
    assert sorted(resumed) == list(range(7, STEPS + 1))
    assert_losses_match(last_loss_per_step(ref_out), resumed, range(7, STEPS + 1))


def test_resume_on_one_rank_with_accumulation_matches_and_exports_to_hf(reference, tmp_path):
    ref_out, _ = reference
    out = tmp_path / "one"
    overrides = [*TINY, *_copy_checkpoint(os.path.join(ref_out, "checkpoints"), 6, str(out)),
                 "training.grad_accum_steps=2"]
    _ok(run([sys.executable, "recipes/train.py", *overrides]))  # plain python: a 1-rank job
    assert_losses_match(last_loss_per_step(ref_out), last_loss_per_step(str(out)), range(7, STEPS + 1))

    # The final checkpoint, exported to HF safetensors, loads into a plain model with the
    # same outputs as the checkpoint loaded through the sharded-checkpoint reader.
    hf_dir = tmp_path / "hf"
    _ok(run([sys.executable, "scripts/export_hf.py", os.path.join(ref_out, "checkpoints"), str(hf_dir), "--format", "native"]))
    config = json.loads((hf_dir / "config.json").read_text())
    config.pop("architectures")
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in set(index["weight_map"].values()):
        tensors.update(load_file(hf_dir / file))
    from_hf = Transformer(LlamaConfig(**config))
    from_hf.load_state_dict(tensors, strict=False)
    assert set(tensors) == set(from_hf.state_dict())
    from_ckpt = Transformer(LlamaConfig(**config))
    assert CheckpointManager(os.path.join(ref_out, "checkpoints")).load_latest({"model": ModelState(from_ckpt)}) == 12
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(from_hf(tokens), from_ckpt(tokens), rtol=0, atol=0)
    fresh = Transformer(LlamaConfig(**config))
    fresh.init_weights(0)
    assert not torch.allclose(fresh(tokens), from_hf(tokens))

    listing = _ok(run([sys.executable, "scripts/inspect_checkpoint.py", os.path.join(ref_out, "checkpoints")]))
    assert "step: 12" in listing and "model.layers.0.attention.wq.weight" in listing and "mesh 2" in listing


@pytest.mark.slow  # torchrun's restart: test_memory_recovery.py's killed worker; the durable resume: in-process
def test_killed_rank_restarts_and_resumes(reference, tmp_path):
    ref_out, _ = reference
    proc = start(torchrun_cmd(2, [*TINY, f"output_dir={tmp_path}", "checkpoint.interval=3"],
                              extra=["--standalone", "--max-restarts=1", "--monitor-interval=0.1"]))
    wait_for_step(str(tmp_path), 4, proc)  # step 3's checkpoint (a synchronous save) is committed
    workers = worker_pids(proc.pid)
    assert 1 in workers, f"rank 1 not found among torchrun's children {workers}"
    os.kill(workers[1], signal.SIGKILL)
    output = finish(proc, timeout=150)
    assert proc.returncode == 0, output
    steps = [r["step"] for r in read_metrics(str(tmp_path))]
    assert steps[-1] == STEPS and len(steps) > STEPS, "no step was run twice: the job did not restart"
    assert "resumed from" in output
    assert_losses_match(last_loss_per_step(ref_out), last_loss_per_step(str(tmp_path)))


def test_sigterm_saves_a_final_checkpoint_and_exits_0(tmp_path):
    proc = start(["env", "NPROC=2", f"TORCHRUN={os.path.dirname(sys.executable)}/torchrun",
                  f"PYTHON={sys.executable}", "scripts/train.sh", *TINY, f"output_dir={tmp_path}",
                  "checkpoint.interval=100", "training.steps=400"])
    wait_for_step(str(tmp_path), 3, proc, timeout=240)  # the config check, then torchrun, on a busy CPU
    proc.send_signal(signal.SIGTERM)  # scripts/train.sh passes it to every rank
    output = finish(proc, timeout=60)
    assert proc.returncode == 0, output
    assert "Traceback" not in output, output
    last = read_metrics(str(tmp_path))[-1]["step"]
    assert last < 400
    assert f"SIGTERM: saved a final checkpoint at step {last}" in output
    assert sorted(set(os.listdir(tmp_path / "checkpoints")) - {LOCK_FILE}) == [f"step-{last}"]
    assert is_checkpoint(str(tmp_path / "checkpoints" / f"step-{last}"))
    # ... and a 1-rank job continues from it.
    resumed = _ok(run([sys.executable, "recipes/train.py", *TINY, f"output_dir={tmp_path}",
                       f"training.steps={last + 1}", "checkpoint.interval=100"]))
    assert f"resumed from {tmp_path}/checkpoints/step-{last}" in resumed
    assert read_metrics(str(tmp_path))[-1]["step"] == last + 1


@pytest.mark.slow  # text data: test_ops_e2e.py; bf16 with checkpointing: test_tensor_parallel.py (in-process)
def test_text_data_in_bf16_with_activation_checkpointing(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    stdout = _ok(run([sys.executable, "recipes/train.py", *TINY, "training.steps=4", f"output_dir={tmp_path}",
                      "data=text", f"data.paths={text}", "parallel.mixed_precision=bf16",
                      "model.activation_checkpointing=true"]))
    # The dtypes bf16 actually computes in are checked in test_mixed_precision.py.
    assert "data text" in stdout
    records = read_metrics(str(tmp_path))
    assert [r["step"] for r in records] == [1, 2, 3, 4] and "loss_floor" not in records[0]
    assert records[-1]["loss"] < records[0]["loss"]


@pytest.mark.slow  # init_from: test_hf_interop.py, test_ops_e2e.py; data=tokens: in-process recipe tests
def test_token_file_data_and_init_from_hf(tmp_path):
    """The first step's loss equals a plain model's, initialised from the same HF directory, on
    the first global batch of the token file."""
    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint16).tofile(tokens)
    cfg = typed_config(compose_config([*TINY, "data=tokens", f"data.path={tokens}"]))
    plain = Transformer(llama_config(cfg.model))
    plain.init_weights(seed=7)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    save_file({k: v.contiguous() for k, v in plain.state_dict().items()}, hf_dir / "model.safetensors")
    stdout = _ok(run(torchrun_cmd(2, [*TINY, "training.steps=2", f"output_dir={tmp_path / 'out'}", "data=tokens",
                                      f"data.path={tokens}", "data.dtype=uint16", f"model.init_from={hf_dir}"],
                                  extra=["--standalone"])))
    assert f"starting at step 0 from the weights in {hf_dir} (model.init_from)" in stdout
    batch = build_loader(cfg.data, cfg.training, cfg.parallel, 256, dp_rank=0, dp_size=1).next_batch()
    with torch.no_grad():
        expected = F.cross_entropy(plain(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).item()
    first = read_metrics(str(tmp_path / "out"))[0]
    assert first["loss"] == pytest.approx(expected, rel=1e-5)


def test_bad_configs_fail_fast_and_readably(tmp_path):
    def no_traceback_from_the_recipe(stderr):
        assert "recipes/train.py\", line" not in stderr and "hyper_parallel/" not in stderr, stderr

    # scripts/train.sh checks the config before torchrun starts: one line, exit 2, no torchrun.
    # Beside it, a problem found after the process group started (reading the data).
    bad = start(["env", "NPROC=2", f"TORCHRUN={os.path.dirname(sys.executable)}/torchrun",
                 f"PYTHON={sys.executable}", "scripts/train.sh", f"output_dir={tmp_path}",
                 "parallel.dp_replicate=3", "training.steps=-1"], stderr=subprocess.PIPE)
    missing = start([sys.executable, "recipes/train.py", f"output_dir={tmp_path}", "data=text",
                     f"data.paths={tmp_path}/nope.txt"], stderr=subprocess.PIPE)
    _, bad_err = bad.communicate(timeout=60)
    assert bad.returncode == 2
    assert "dp_replicate=3 does not divide the world size 2" in bad_err, bad_err
    assert "training.steps=-1 must be a positive integer" in bad_err
    assert "ChildFailedError" not in bad_err and "torch.distributed" not in bad_err, bad_err
    no_traceback_from_the_recipe(bad_err)
    # Still one line, exit 2.
    _, missing_err = missing.communicate(timeout=60)
    assert missing.returncode == 2 and "no such data file" in missing_err, missing_err
    no_traceback_from_the_recipe(missing_err)
