#!/usr/bin/env python
"""Show what a checkpoint holds: step, mesh at save, tensors, dtypes, sizes, saved values.

    scripts/inspect_checkpoint.py outputs/train/checkpoints          # the newest step-N in it
    scripts/inspect_checkpoint.py outputs/train/checkpoints/step-40

Delegates to ``python -m hyper_parallel.checkpoint inspect`` (which takes either); exits 1 on a
bad checkpoint.
"""

from __future__ import annotations

import sys

import _checkpoints  # noqa: F401 - puts the repository on sys.path

from hyper_parallel.checkpoint import cli_main


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return cli_main(["inspect", argv[0]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
