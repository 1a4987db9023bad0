"""scripts/plot_metrics.py on bad arguments and records, its panels (one colour per run,
restarts and world-size changes marked), and every optional dependency's missing-package
error naming the extra that installs it."""

from __future__ import annotations

import json
import sys

import pytest

from hyper_parallel._optional import EXTRAS, MissingDependency, require
from tests.recipes.script_main import script_main, script_module

RECIPES_HINT = "pip install 'hyper_parallel[recipes]'"


def _write(path, records) -> str:
    with open(path, "w") as f:
        for record in records:
            f.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


def _plot_record(step, **extra):
    return {"step": step, "loss": 3.0 - step / 10, "lr": 1e-3, "tokens_per_s": 100.0, "tflops": 0.1,
            "memory_bytes": 2**30, **extra}


def _main(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    try:
        code = script_main("plot_metrics")(list(args))
    except SystemExit as exit_:  # argparse
        code = exit_.code
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("args,expected", [
    (["--dpi", "0"], "argument --dpi: '0' is not an integer in [10, 1200]"),
    (["--dpi", "x"], "argument --dpi: 'x' is not an integer in [10, 1200]"),
    (["--width", "-3"], "argument --width: '-3' is not a number in [1, 200]"),
    (["--width", "nan"], "argument --width: 'nan' is not a number in [1, 200]"),
    (["--height", "inf"], "argument --height: 'inf' is not a number in [1, 200]"),
    (["--width", "200", "--dpi", "1200"], "240000 pixels, more than 20,000 per side"),
    (["--out", "{tmp}/plot.jsonl"], "jsonl is not an image format matplotlib writes"),
    (["--out", "{tmp}/plot"], "no suffix is not an image format"),
    (["--out", "{tmp}/no/such/plot.png"], "no folder"),
    (["--out", "{tmp}"], "is a folder"),
])
def test_bad_arguments_give_one_line(tmp_path, capsys, args, expected):
    run = _write(tmp_path / "m.jsonl", [_plot_record(1), _plot_record(2)])
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "p.png")]
    code, err = _main(capsys, run, *args)
    assert code in (1, 2) and len(err.splitlines()) == 1 and err.startswith("error: ") and expected in err, err
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("line,expected", [
    ('{"step": "3", "loss": 1}', "step='3' is not a step number"),
    ('{"step": 2.5, "loss": 1}', "step=2.5 is not a step number"),
    ('{"step": -1, "loss": 1}', "step=-1 is not a step number"),
    ('{"step": 3, "loss": "abc"}', "loss='abc' is not a finite number >= 0"),
    ('{"step": 3, "loss": NaN}', "loss=nan is not a finite number >= 0"),
    ('{"step": 3, "memory_bytes": -5}', "memory_bytes=-5 is not a finite number >= 0"),
    ('{"step": 3, "lr": 1e999}', "lr=inf is not a finite number >= 0"),
    ('{"step": 3, "tflops": [1]}', "tflops=[1] is not a finite number >= 0"),
    ("[1, 2]", "not a metrics record"),
    ("step 3 loss 1", "not JSON (is "),
])
def test_bad_records_name_file_line_and_value(tmp_path, capsys, line, expected):
    run = _write(tmp_path / "m.jsonl", [_plot_record(1), _plot_record(2), line])
    code, err = _main(capsys, run, "--out", str(tmp_path / "p.png"))
    assert code == 1 and err.startswith(f"error: {run}:3: {expected}") and "\n" not in err, err


def test_a_binary_file_is_one_line(tmp_path, capsys):
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(255, -1, -1)) * 4)
    code, err = _main(capsys, str(binary), "--out", str(tmp_path / "p.png"))
    assert code == 1 and err == f"error: {binary}:1: not UTF-8 text (is {binary} a metrics.jsonl?)", err


def test_runs_keep_one_colour_restarts_and_world_size_changes_are_marked(tmp_path):
    from matplotlib.figure import Figure

    plot_metrics = script_module("plot_metrics")
    # then restarted from step 2's checkpoint
    first = _write(tmp_path / "a.jsonl", [_plot_record(s) for s in range(1, 6)]
                   + [_plot_record(s, val_loss=2.0 if s == 6 else None) for s in range(3, 9)])
    second = _write(tmp_path / "b.jsonl", [_plot_record(s, world_size=2 if s < 5 else 4) for s in range(1, 9)])
    runs = {"a": plot_metrics.read_run(first), "b": plot_metrics.read_run(second)}
    assert runs["a"].restarts == [3] and [r["step"] for r in runs["a"].records] == list(range(1, 9))
    assert runs["b"].restarts == [] and runs["b"].world_changes == [(5, 2, 4)]
    fig = Figure()
    plot_metrics.draw(runs, fig)
    colours: dict = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            label = line.get_label()
            if not label.startswith("_"):
                colours.setdefault(label.split(":")[0], set()).add(line.get_color())
    assert colours == {"a": {"C0"}, "b": {"C1"}}
    labels = {line.get_label() for ax in fig.axes for line in ax.get_lines()}
    assert {"a: restart", "a: validation", "b: tokens/s (total)", "b: TFLOP/s per device", "a: allocated"} <= labels
    assert [t.get_text() for t in fig.axes[0].texts] == ["world 2->4"]
    ylabels = [ax.get_ylabel() for ax in fig.axes]
    assert "tokens/s, all ranks together" in ylabels and "TFLOP/s per device" in ylabels
    assert "GiB per rank" in ylabels


def test_an_moe_run_gets_an_expert_load_panel_and_the_aux_loss_on_its_own_axis(tmp_path, capsys):
    from matplotlib.figure import Figure

    from hyper_parallel.trainer.observability.metrics import moe_record

    plot_metrics = script_module("plot_metrics")
    # What the MoE recipe writes: 2 blocks of 4 experts over 1 rank, block 1 the busier one.
    records = [_plot_record(s, **moe_record([0.1 / s, 3, 3, 3, 3, 3 + s, 3 - s, 3, 3], loss_ranks=1, num_experts=4))
               for s in range(1, 4)]
    run = _write(tmp_path / "moe.jsonl", records)
    fig = Figure()
    plot_metrics.draw({"moe": plot_metrics.read_run(run), "dense": plot_metrics.read_run(
        _write(tmp_path / "dense.jsonl", [_plot_record(s) for s in range(1, 4)]))}, fig)
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert list(panels)[-2:] == ["expert load (MoE)", "load-balancing loss (MoE)"]

    def lines(title):
        return {line.get_label(): line for line in panels[title].get_lines()}

    load = lines("expert load (MoE)")
    assert list(load["moe: worst block"].get_ydata()) == [r["expert_load"] for r in records]
    assert [r["expert_load"] for r in records] == pytest.approx([4 / 3, 5 / 3, 2])
    blocks = [line for line in panels["expert load (MoE)"].get_lines() if line.get_linewidth() == 0.6]
    assert [list(line.get_ydata()) for line in blocks] == [[1.0] * 3, [r["expert_load"] for r in records]]
    assert "balanced" in load and "moe: each MoE block" in load
    aux = lines("load-balancing loss (MoE)")
    assert list(aux["moe: aux loss"].get_ydata()) == pytest.approx([0.1, 0.05, 0.1 / 3])
    assert "dense: aux loss" not in aux
    assert not any("aux" in label for label in lines("loss"))  # not on the loss's log axis
    fig = Figure()
    plot_metrics.draw({"dense": plot_metrics.read_run(tmp_path / "dense.jsonl")}, fig)
    assert "expert load (MoE)" not in [ax.get_title() for ax in fig.axes]  # a dense run: the four panels
    bad = _write(tmp_path / "bad.jsonl", [_plot_record(1, expert_load_per_block=[1.0, "x"])])
    code, err = _main(capsys, bad, "--out", str(tmp_path / "p.png"))
    assert code == 1 and err == f"error: {bad}:1: expert_load_per_block=[1.0, 'x'] is not a list of finite numbers >= 0"


@pytest.mark.parametrize("package", sorted(EXTRAS))
def test_every_optional_package_names_its_extra(monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # import of it fails as if not installed
    with pytest.raises(MissingDependency, match=f"^reading x needs the '{package}' package: pip install "
                                                f"'hyper_parallel\\[{EXTRAS[package]}\\]'$"):
        require(package, "reading x")


def test_missing_packages_at_their_entry_points(tmp_path, monkeypatch, capsys):
    from hyper_parallel.data import iter_documents, load_tokenizer
    from tests.recipes.corpus import documents, train_tokenizer

    tokenizer = train_tokenizer(documents(4), str(tmp_path / "tokenizer.json"))
    (tmp_path / "c.parquet").write_bytes(b"")
    (tmp_path / "c.txt").write_text("hello")
    (tmp_path / "m.jsonl").write_text(json.dumps(_plot_record(1)) + "\n")
    for package in ("tokenizers", "pyarrow", "tqdm", "matplotlib"):
        monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(MissingDependency, match=r"tokenizer.json tokenizer needs the 'tokenizers' package: "
                                                r"pip install 'hyper_parallel\[recipes\]'"):
        load_tokenizer(tokenizer)
    with pytest.raises(MissingDependency, match=r"c.parquet needs the 'pyarrow' package"):
        list(iter_documents(str(tmp_path / "c.parquet")))
    for script, args in (("prepare_data", [str(tmp_path / "c.txt"), "--output", str(tmp_path / "t.bin")]),
                         ("plot_metrics", [str(tmp_path / "m.jsonl"), "--out", str(tmp_path / "p.png")])):
        capsys.readouterr()
        assert script_main(script)(args) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: scripts/") and err.endswith(RECIPES_HINT) and "\n" not in err, err


def test_the_tensorboard_config_check_names_its_extra(monkeypatch, tmp_path):
    from hyper_parallel.trainer import ConfigError, compose_config, validate_config
    from hyper_parallel.trainer.launch import preflight

    monkeypatch.setattr(preflight, "available", lambda package: package != "tensorboard")
    config = validate_config(compose_config(["logging.tensorboard=true", f"output_dir={tmp_path}"]), 1)
    with pytest.raises(ConfigError, match=r"logging.tensorboard=true needs the 'tensorboard' package: pip install "
                                          r"'hyper_parallel\[tensorboard\]', or set logging.tensorboard=false"):
        preflight.check_environment(config.cfg, config.dims, ranks_per_node=1)
