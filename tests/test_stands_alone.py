"""The repository stands alone: no tracker numbers, no absolute machine paths and no pointer to
files outside it in the tracked text files."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = (".py", ".md", ".sh", ".yaml", ".toml", ".txt", ".cfg")
FORBIDDEN = {
    "tracker number": re.compile(r"\bissues? ?#?\d+\b|\bissue-\d+\b", re.IGNORECASE),
    "machine path": re.compile(r"(?<![\w.])/(?:work|root|home/\w+)/"),
    "file outside the repository": re.compile(r"shared folder|\.\./shared/|DESIGN\.md"),
}


def _tracked_text_files():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    names = [n for n in out.splitlines() if n.endswith(TEXT) or os.path.basename(n) in ("Makefile", "Dockerfile")]
    return [n for n in names if n != "tests/test_stands_alone.py"]


def test_no_tracker_numbers_machine_paths_or_outside_pointers():
    found = []
    for name in _tracked_text_files():
        path = os.path.join(REPO, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                found += [f"{name}:{lineno}: {what}: {line.strip()[:100]}"
                          for what, pattern in FORBIDDEN.items() if pattern.search(line)]
    assert not found, "\n".join(found)
