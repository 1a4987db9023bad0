"""Shared by the scripts: an argument parser whose errors are one line, and checked number types."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Callable, NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that reports a bad argument as one ``error: ...`` line (exit 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return bounded(int, 1, None)(text)


def bounded(kind: type, low: float, high: float | None) -> Callable[[str], float]:
    """argparse type: a finite ``kind`` (int or float) in ``[low, high]`` (no upper bound: None)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < low or (high is not None and value > high):
            noun = "an integer" if kind is int else "a number"
            wanted = f"{noun} >= {low:g}" if high is None else f"{noun} in [{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"{text!r} is not {wanted}")
        return value
    return parse


def fail(message: str) -> int:
    """Print ``error: message`` to stderr; the exit code of a bad input (1)."""
    print(f"error: {message}", file=sys.stderr)
    return 1
