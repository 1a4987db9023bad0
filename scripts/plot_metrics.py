#!/usr/bin/env python
"""Plot one or more runs' metrics.jsonl into one image: loss (train, and validation where
logged), learning rate, throughput (tokens/s of all ranks together, TFLOP/s per device) and
peak memory per rank, against the step; for a mixture of experts (records with ``expert_load``
or ``aux_loss``) also the expert load (the busiest expert's tokens over the mean tokens per
expert: the worst MoE block's, ``expert_load``, and each block's, ``expert_load_per_block``; 1
is balanced) and the load-balancing (aux) loss, each on its own axis.

    scripts/plot_metrics.py RUN [RUN ...] --out metrics.png [--labels a b ...] [--width 12 --height 8 --dpi 100]

A RUN is a metrics.jsonl file or the output_dir holding one. Several runs share the axes (e.g.
a resumed run over the uninterrupted one), one colour per run in every panel. Where a
restarted job logged a step again (its step went back: it resumed from an earlier checkpoint),
the last record wins and the restart is marked by a dotted vertical line; where records carry
``world_size`` and it changes, the change is marked and labelled. The image is width x dpi by
height x dpi pixels; its format follows the --out suffix (.png, .pdf, .svg, ...).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List, NamedTuple, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _cli import OneLineParser, bounded, fail  # noqa: E402

from hyper_parallel._optional import MissingDependency, require  # noqa: E402

# (panel title, y label, [(record key, legend name, line style)]); every value is >= 0.
_PANELS = (
    ("loss", "nats/token", [("loss", "train", "-"), ("val_loss", "validation", "o--")]),
    ("learning rate", "lr", [("lr", "lr", "-")]),
    ("throughput", "tokens/s, all ranks together", [("tokens_per_s", "tokens/s (total)", "-")]),
    ("peak memory per rank (rank 0)", "GiB per rank", [("memory_bytes", "allocated", "-"),
                                                       ("memory_reserved_bytes", "reserved", "--")]),
)
# Drawn when a run has them (a mixture of experts); each block's load as thin lines under the worst.
_MOE_PANELS = (
    ("expert load (MoE)", "busiest expert / mean tokens per expert", [("expert_load", "worst block", "-")]),
    ("load-balancing loss (MoE)", "aux loss (weighted)", [("aux_loss", "aux loss", "-")]),
)
_PER_BLOCK = "expert_load_per_block"
_TWIN = ("tflops", "TFLOP/s per device", ":")  # on the throughput panel's right axis
_NUMBERS = tuple(key for _, _, lines in _PANELS + _MOE_PANELS for key, _, _ in lines) + (_TWIN[0], "world_size")
MAX_PIXELS = 20_000  # per side


class Run(NamedTuple):
    records: List[dict]                       # one per step (the last logged wins), in step order
    restarts: List[int]                       # first step logged by each restarted job
    world_changes: List[Tuple[int, int, int]]  # (step, old world_size, new world_size)


def _check_record(record: object, where: str) -> dict:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: not a metrics record (a JSON object)")
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**53:
        raise ValueError(f"{where}: step={step!r} is not a step number (an integer >= 0)")
    for key in _NUMBERS:
        value = record.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}: {key}={value!r} is not a finite number >= 0")
    loads = record.get(_PER_BLOCK)
    if loads is not None and not (isinstance(loads, list) and all(
            not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in loads)):
        raise ValueError(f"{where}: {_PER_BLOCK}={loads!r} is not a list of finite numbers >= 0")
    return record


def read_run(path: str) -> Run:
    """A run's records, restarts and world-size changes.

    Raises:
        OSError: unreadable. ValueError: naming the file, the line and what is wrong with it.
    """
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    by_step: Dict[int, dict] = {}
    restarts: List[int] = []
    changes: List[Tuple[int, int, int]] = []
    last_step, world = None, None
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"{where}: not UTF-8 text (is {path} a metrics.jsonl?)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                raise ValueError(f"{where}: not JSON (is {path} a metrics.jsonl?)") from None
            if isinstance(record, dict) and "event" in record:
                continue  # not a step: e.g. a recovery (docs/recipes.md, "Recovering from failures")
            step = _check_record(record, where)["step"]
            if last_step is not None and step <= last_step:
                restarts.append(step)
            if record.get("world_size") is not None:
                if world is not None and record["world_size"] != world:
                    changes.append((step, world, record["world_size"]))
                world = record["world_size"]
            by_step[step], last_step = record, step
    if not by_step:
        raise ValueError(f"{path} holds no records")
    return Run([by_step[s] for s in sorted(by_step)], restarts, changes)


def _draw_blocks(ax, run: Run, label: str, colour: str) -> None:
    """Each MoE block's expert load of ``run``, thin lines in its colour (one legend entry)."""
    points = [(r["step"], r[_PER_BLOCK]) for r in run.records if r.get(_PER_BLOCK)]
    for block in range(max((len(loads) for _, loads in points), default=0)):
        steps = [(step, loads[block]) for step, loads in points if block < len(loads)]
        ax.plot(*zip(*steps), "-", color=colour, linewidth=0.6, alpha=0.4,
                label=f"{label}: each MoE block" if block == 0 else None)


def draw(runs: Dict[str, Run], fig) -> None:
    """The panels of every run into ``fig`` (a matplotlib Figure): one colour per run; four,
    and two more (expert load, aux loss) when a run has MoE metrics."""
    moe = any(r.get(key) is not None for run in runs.values() for r in run.records
              for key in ("expert_load", "aux_loss"))
    panels = _PANELS + (_MOE_PANELS if moe else ())
    axes = fig.subplots(len(panels) // 2, 2)
    for ax, (title, ylabel, lines) in zip(axes.flat, panels):
        twin = ax.twinx() if title == "throughput" else None
        for i, (label, run) in enumerate(runs.items()):
            colour = f"C{i % 10}"
            for key, name, style in lines + ([_TWIN] if twin is not None else []):
                points = [(r["step"], r[key]) for r in run.records if r.get(key) is not None]
                if not points:
                    continue
                steps, values = zip(*points)
                if key.startswith("memory"):
                    values = [v / 2**30 for v in values]
                target = twin if key == _TWIN[0] else ax
                target.plot(steps, values, style, color=colour, label=f"{label}: {name}", markersize=3)
            if title == _MOE_PANELS[0][0]:
                _draw_blocks(ax, run, label, colour)
            for n, step in enumerate(run.restarts):
                ax.axvline(step, color=colour, linestyle=":", linewidth=1,
                           label=f"{label}: restart" if n == 0 else None)
            for step, old, new in run.world_changes:
                ax.axvline(step, color=colour, linestyle="-.", linewidth=1)
                ax.annotate(f"world {old}->{new}", (step, 1), xycoords=("data", "axes fraction"),
                            rotation=90, va="top", ha="right", fontsize="x-small", color=colour)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        if title == "loss":
            ax.set_yscale("log")
        if title == _MOE_PANELS[0][0]:
            ax.axhline(1.0, color="grey", linestyle=":", linewidth=1, label="balanced")
        handles, names = ax.get_legend_handles_labels()
        if twin is not None:
            twin.set_ylabel(_TWIN[1])
            more, more_names = twin.get_legend_handles_labels()
            handles, names = handles + more, names + more_names
        if handles:
            ax.legend(handles, names, fontsize="small")
    fig.tight_layout()


def plot(runs: Dict[str, Run], out: str, *, width: float = 12, height: float = 8, dpi: int = 100) -> None:
    """Draw every run into ``out`` (format from its suffix).

    Raises:
        MissingDependency: matplotlib is not installed. ValueError: a suffix matplotlib cannot write.
    """
    figure = require("matplotlib.figure", "scripts/plot_metrics.py")  # no pyplot: no GUI backend
    fig = figure.Figure(figsize=(width, height), dpi=dpi)
    suffix = os.path.splitext(out)[1].lstrip(".").lower()
    formats = fig.canvas.get_supported_filetypes()
    if suffix not in formats:
        raise ValueError(f"--out {out}: {suffix or 'no suffix'} is not an image format matplotlib writes "
                         f"({', '.join(sorted(formats))})")
    draw(runs, fig)
    fig.savefig(out, dpi=dpi)


def main(argv: list[str]) -> int:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--labels", nargs="+")
    parser.add_argument("--width", type=bounded(float, 1, 200), default=12, help="inches")
    parser.add_argument("--height", type=bounded(float, 1, 200), default=8, help="inches")
    parser.add_argument("--dpi", type=bounded(int, 10, 1200), default=100)
    args = parser.parse_args(argv)
    labels = args.labels or [os.path.basename(os.path.normpath(r)) or r for r in args.runs]
    if len(labels) != len(args.runs):
        return fail(f"{len(labels)} labels for {len(args.runs)} runs")
    if max(args.width, args.height) * args.dpi > MAX_PIXELS:
        return fail(f"--width/--height x --dpi = {max(args.width, args.height) * args.dpi:g} pixels, more than "
                    f"{MAX_PIXELS:,} per side")
    folder = os.path.dirname(os.path.abspath(args.out))
    if os.path.isdir(args.out) or not os.path.isdir(folder):
        return fail(f"--out {args.out}: " + ("is a folder" if os.path.isdir(args.out) else f"no folder {folder}"))
    try:
        runs = {label: read_run(path) for label, path in zip(labels, args.runs)}
        plot(runs, args.out, width=args.width, height=args.height, dpi=args.dpi)
    except (OSError, ValueError, MissingDependency) as err:
        return fail(str(err))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
