"""The trainer package's layers, from its import graph: each folder or top-level module imports
only the ones below it (trainer/__init__.py lists them bottom up). Imports are
read with ``ast`` (function-level ones too); nothing is imported."""

from __future__ import annotations

import os
from typing import Tuple

import hyper_parallel.trainer as trainer
from tests.import_graph import unit_graph, unit_layer_violations

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "hyper_parallel.trainer"

# Bottom to top; a unit imports only units of lower rows.
LAYERS: Tuple[Tuple[str, ...], ...] = (
    ("config",), ("observability",), ("setup",), ("step",), ("checkpointing",), ("job",), ("launch",), ("loop",),
)


def test_every_import_runs_to_a_lower_layer():
    graph = unit_graph(ROOT, PACKAGE)
    assert set(graph) == {unit for row in LAYERS for unit in row}, sorted(graph)
    assert unit_layer_violations(graph, LAYERS, "place it in LAYERS and in trainer/__init__.py") == []


def test_the_packages_docstring_lists_the_layers_bottom_up():
    listed = [line.split("``")[1].removesuffix("/").removesuffix(".py")
              for line in trainer.__doc__.splitlines() if line.startswith("- ``")]
    assert listed == [unit for row in LAYERS for unit in row]
