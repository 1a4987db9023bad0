#!/usr/bin/env python
"""Plot one or more runs' metrics.jsonl into one PNG: loss (train, and validation where logged),
learning rate, throughput (tokens/s, TFLOP/s per device) and peak memory, against the step.

    scripts/plot_metrics.py RUN [RUN ...] --out metrics.png [--labels a b ...] [--width 12 --height 8 --dpi 100]

A RUN is a metrics.jsonl file or the output_dir holding one. Several runs share the axes (e.g.
a resumed run over the uninterrupted one). Where a restarted job logged a step twice, the last
record wins. The image is width x dpi by height x dpi pixels.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List


def read_run(path: str) -> List[dict]:
    """The step records of a run, one per step (the last one logged wins), in step order."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path) as f:
        by_step: Dict[int, dict] = {}
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    record = json.loads(line)
                    by_step[int(record["step"])] = record
                except (ValueError, KeyError, TypeError):
                    raise ValueError(f"{path}:{number}: not a metrics record") from None
    if not by_step:
        raise ValueError(f"{path} holds no records")
    return [by_step[s] for s in sorted(by_step)]


_PANELS = (("loss", ("loss", "val_loss")), ("learning rate", ("lr",)),
           ("throughput", ("tokens_per_s", "tflops")), ("peak memory (GiB)", ("memory_bytes", "memory_reserved_bytes")))


def plot(runs: Dict[str, List[dict]], out: str, *, width: float = 12, height: float = 8, dpi: int = 100) -> None:
    """Draw the four panels for every run into ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(width, height), dpi=dpi)
    for ax, (title, keys) in zip(axes.flat, _PANELS):
        twin = ax.twinx() if title == "throughput" else None
        for label, records in runs.items():
            for key in keys:
                points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
                if not points:
                    continue
                steps, values = zip(*points)
                if key.startswith("memory"):
                    values = [v / 2**30 for v in values]
                target = twin if (twin is not None and key == "tflops") else ax
                style = "o--" if key.startswith("val_") else ":" if key == "tflops" else "-"
                target.plot(steps, values, style, label=f"{label}: {key}", markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        if title == "loss":
            ax.set_yscale("log")
        handles, names = ax.get_legend_handles_labels()
        if twin is not None:
            more, more_names = twin.get_legend_handles_labels()
            handles, names = handles + more, names + more_names
            twin.set_ylabel("TFLOP/s per device")
            ax.set_ylabel("tokens/s")
        if handles:
            ax.legend(handles, names, fontsize="small")
    fig.tight_layout()
    fig.savefig(out, dpi=dpi)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--labels", nargs="+")
    parser.add_argument("--width", type=float, default=12)
    parser.add_argument("--height", type=float, default=8)
    parser.add_argument("--dpi", type=int, default=100)
    args = parser.parse_args(argv)
    labels = args.labels or [os.path.basename(os.path.normpath(r)) or r for r in args.runs]
    if len(labels) != len(args.runs):
        print(f"error: {len(labels)} labels for {len(args.runs)} runs", file=sys.stderr)
        return 1
    try:
        runs = {label: read_run(path) for label, path in zip(labels, args.runs)}
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    plot(runs, args.out, width=args.width, height=args.height, dpi=args.dpi)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
