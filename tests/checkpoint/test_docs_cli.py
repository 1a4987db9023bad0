"""The checkpoint docs' snippets run as written, ``inspect`` prints values, HF export
files follow the umask."""

from __future__ import annotations

import os
import re

import pytest
import torch

from hyper_parallel import checkpoint as hdcp
from hyper_parallel.core.distributed_checkpoint.cli import main as cli_main

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                   "docs", "checkpoint.md")


def _snippets():
    with open(DOC) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.S)


def _model_and_optim():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, optim


def test_first_snippet_runs_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, optim = _model_and_optim()
    scope = {"model": model, "optim": optim, "step": 100}
    exec(_snippets()[0], scope)  # noqa: S102 - the documentation's own code
    scope["future"].result(timeout=120)
    assert hdcp.is_checkpoint("ckpt/step-100") and hdcp.is_checkpoint("ckpt/step-200")


def test_checkpoint_manager_snippet_restores_the_scheduler(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    snippet = next(s for s in _snippets() if "CheckpointManager(" in s)

    def run():
        model, optim = _model_and_optim()
        scheduler = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)

        def train_step():
            model(torch.ones(2, 4)).sum().backward()
            optim.step()
            optim.zero_grad()
            scheduler.step()

        scope = {"hdcp": hdcp, "model": model, "optim": optim, "scheduler": scheduler,
                 "train_step": train_step, "steps": 3}
        exec(snippet, scope)  # noqa: S102 - the documentation's own code
        scope["manager"].close()
        return scope

    first = run()
    assert first["start"] == 0 and first["scheduler"].last_epoch == 3
    second = run()  # resumes: the scheduler comes back at epoch 3, not 0
    assert second["start"] == 3 and second["scheduler"].last_epoch == 3
    assert second["scheduler"].get_last_lr() == first["scheduler"].get_last_lr()


def test_inspect_prints_the_values(tmp_path, capsys):
    path = str(tmp_path / "step-5")
    hdcp.save({"w": torch.ones(2), "train": {"step": 5, "name": "run-a", "betas": (0.9, 0.95)}},
              checkpoint_id=path, no_dist=True)
    assert cli_main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "train.step = 5" in out and "train.name = 'run-a'" in out and "train.betas = (0.9, 0.95)" in out


def test_hf_export_files_follow_the_umask(tmp_path):
    path = str(tmp_path / "ckpt")
    hdcp.save({"model": {"w": torch.ones(3)}}, checkpoint_id=path, no_dist=True)
    old = os.umask(0o022)
    try:
        hdcp.export_hf(path, str(tmp_path / "hf"))
    finally:
        os.umask(old)
    for name in os.listdir(tmp_path / "hf"):
        assert os.stat(tmp_path / "hf" / name).st_mode & 0o777 == 0o644, name


def test_save_and_load_take_stateful_wrappers_as_documented(tmp_path):
    # docs/checkpoint.md, "Model and optimizer state dicts": top-level ModelState/OptimizerState
    # go to save/load directly; nested deeper they are refused, naming the key.
    model, optim = _model_and_optim()
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    path = str(tmp_path / "ckpt")
    hdcp.save({"model": hdcp.ModelState(model), "optim": hdcp.OptimizerState(model, optim)}, checkpoint_id=path,
              no_dist=True)
    torch.manual_seed(1)
    model2 = torch.nn.Linear(4, 3)
    optim2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    hdcp.load({"model": hdcp.ModelState(model2), "optim": hdcp.OptimizerState(model2, optim2)}, checkpoint_id=path,
              no_dist=True)
    assert torch.equal(model2.weight, model.weight) and optim2.param_groups[0]["lr"] == 0.1
    assert torch.equal(optim2.state[model2.weight]["exp_avg"], optim.state[model.weight]["exp_avg"])
    with pytest.raises(TypeError, match="'nested.model'"):
        hdcp.save({"nested": {"model": hdcp.ModelState(model)}}, checkpoint_id=str(tmp_path / "x"), no_dist=True)
