"""Installing extras keeps the installed torch: every extras install in the README and docs is
``make extras`` (or a pip line with a constraint), and the Makefile's installs pass a constraint
holding the installed torch. A plain ``pip install -e '.[test]'`` into a venv with torch
2.13.0+cpu once put a multi-GB CUDA torch 2.15 there (pip's resolver backtracked through the
s3fs chain and re-picked torch within pyproject's range)."""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
from importlib.metadata import version

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", *sorted(glob.glob("docs/*.md", root_dir=REPO)), "benchmarks/README.md"]
# An install of this package with extras: hyper_parallel[...] or .[...] (an editable checkout).
EXTRAS_INSTALL = re.compile(r"pip\s+install\b.*?(?:hyper_parallel|\.)\[[\w,-]+\]", re.S)
PINNED = re.compile(r"(?:^|\s)(?:-c|--constraint)(?:\s|=)|PIP_CONSTRAINT=")


def _declared_extras() -> set:
    with open(os.path.join(REPO, "pyproject.toml")) as f:
        section = f.read().split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+)\s*=", section, re.M))


def _commands(text: str) -> list:
    """The lines of fenced code blocks and the inline code spans (which may wrap) of Markdown."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, re.S)
    rest = re.sub(r"```.*?```", "", text, flags=re.S)
    return [line for block in blocks for line in block.splitlines()] + re.findall(r"`([^`]+)`", rest)


def _doc_commands() -> dict:
    found = {}
    for name in DOCS:
        with open(os.path.join(REPO, name)) as f:
            found[name] = [" ".join(c.split()) for c in _commands(f.read())]
    return found


def test_every_extras_install_in_the_docs_keeps_the_installed_torch():
    extras, unpinned, made = _declared_extras(), [], []
    for name, commands in _doc_commands().items():
        unpinned += [f"{name}: {c}" for c in commands if EXTRAS_INSTALL.search(c) and not PINNED.search(c)]
        made += [(name, m) for c in commands for m in re.findall(r"make extras EXTRAS=([\w,-]+)", c)]
    assert not unpinned, "pip installs of extras that may replace torch (use make extras EXTRAS=...):\n" + \
        "\n".join(unpinned)
    assert {"recipes", "s3"} <= {e for _, m in made for e in m.split(",")}, made
    for name, named in made:
        assert set(named.split(",")) <= extras, f"{name}: make extras EXTRAS={named} names an unknown extra"


def test_the_checker_sees_an_unpinned_wrapped_install():
    text = "Install (`pip\ninstall -e '.[recipes]'`) or\n```bash\npip install 'hyper_parallel[s3]' -c pin.txt\n```\n"
    commands = [" ".join(c.split()) for c in _commands(text)]
    assert [bool(EXTRAS_INSTALL.search(c)) and not PINNED.search(c) for c in commands] == [False, True]


def _make_dry_run(target: str, venv: str, **variables: str) -> list:
    """The commands ``make -n`` would run for ``target`` with the venv at ``venv`` (this
    interpreter as its python), one per line."""
    args = ["make", "-n", "-C", REPO, target, f"VENV={venv}", f"PY={sys.executable}",
            *(f"{k}={v}" for k, v in variables.items())]
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=60).stdout.splitlines()


@pytest.mark.parametrize("target, extras", [("extras", "recipes,s3"), ("install", "test")])
def test_the_makefiles_installs_pin_the_installed_torch(tmp_path, target, extras):
    commands = _make_dry_run(target, str(tmp_path / "venv"), EXTRAS=extras)
    (tmp_path / "venv").mkdir()
    pin = tmp_path / "venv" / "torch-constraint.txt"
    writes = [c for c in commands if c.endswith(f"> {pin}")]
    assert len(writes) == 1, commands
    subprocess.run(writes[0], shell=True, check=True, timeout=60)  # writes the constraint for this interpreter
    assert pin.read_text().split() == [f"torch=={version('torch')}"]
    installs = [shlex.split(c) for c in commands if f".[{extras}]" in c]
    assert len(installs) == 1 and installs[0][installs[0].index("-c") + 1] == str(pin), commands
    assert commands.index(writes[0]) < [shlex.split(c) for c in commands].index(installs[0])


def test_the_dockerfile_install_pins_the_installed_torch():
    with open(os.path.join(REPO, "Dockerfile")) as f:
        runs = " ".join(f.read().replace("\\\n", " ").split()).split("RUN ")
    installs = [r for r in runs if EXTRAS_INSTALL.search(r.replace('".${EXTRAS}"', ".[x]"))]
    assert len(installs) == 1 and PINNED.search(installs[0]), installs
