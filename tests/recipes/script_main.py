"""Run a ``scripts/*.py`` entry point in the test process (for scripts that need no process group)."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import Callable, List

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts")


def script_main(name: str) -> Callable[[List[str]], int]:
    """The ``main(argv) -> exit code`` of ``scripts/<name>.py`` (its sibling imports resolve)."""
    return script_module(name).main


def script_module(name: str) -> ModuleType:
    """``scripts/<name>.py`` imported as a module (its sibling imports resolve)."""
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
