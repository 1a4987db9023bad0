"""The checkpoint package's layers, from its import graph: each subpackage or top-level module
imports only the layers below it (so no two of them import each other, and the two storage
backends never import one another), and docs/checkpoint.md's "Code layout" lists the layers in
this order. Imports are read with ``ast`` (function-level ones too); nothing is imported."""

from __future__ import annotations

import os
from typing import Dict, List, Set, Tuple

import pytest

from tests.import_graph import unit_graph, unit_layer_violations

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = "hyper_parallel.core.distributed_checkpoint"
PACKAGE_DIR = os.path.join(ROOT, *PACKAGE.split("."))
DOC = os.path.join(ROOT, "docs", "checkpoint.md")

# Bottom to top. A unit (subpackage or top-level module) may import only units of lower rows;
# units of one row never import each other. The package's __init__.py (its face) is above all.
LAYERS: Tuple[Tuple[str, ...], ...] = (
    ("errors",),
    ("_fileio",),
    ("format",),
    ("planner", "stateful"),
    ("storage",),
    ("planning", "host_memory", "encoding"),
    ("filesystem", "object_store"),
    ("stores",),
    ("dcp_interop",),
    ("api",),
    ("state_dict",),
    ("manager", "hf", "optimizer_state_dict"),
    ("cli",),
)


def import_graph() -> Dict[str, Set[Tuple[str, str]]]:
    return unit_graph(ROOT, PACKAGE)


def layer_violations(graph: Dict[str, Set[Tuple[str, str]]], layers=LAYERS) -> List[str]:
    return unit_layer_violations(graph, layers, "place it in LAYERS and in docs/checkpoint.md")


def test_every_import_runs_to_a_lower_layer():
    graph = import_graph()
    assert {"filesystem", "object_store", "api", "manager"} <= set(graph)
    assert layer_violations(graph) == []


def test_a_sideways_or_upward_import_is_named():
    graph = {"filesystem": {("object_store", "filesystem/x.py")}, "format": {("api", "format/y.py")},
             "api": {("format", "api.py")}, "newcomer": set()}
    assert layer_violations(graph) == [
        "newcomer is in no layer: place it in LAYERS and in docs/checkpoint.md",
        "filesystem/x.py imports object_store, which is in its own layer than filesystem",
        "format/y.py imports api, which is in a higher layer than format",
    ]


def _doc_rows() -> List[List[str]]:
    """The units named in the first column of each row of docs/checkpoint.md's layout table."""
    section = open(DOC).read().split("## Code layout", 1)[1]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            rows.append([name.strip("`").removesuffix("/").removesuffix(".py")
                         for name in first.replace(",", " ").split() if name.startswith("`")])
    return rows


def test_the_documented_layout_lists_the_layers_top_down():
    rows = _doc_rows()
    documented = [unit for row in rows for unit in row]
    expected = [unit for row in reversed(LAYERS) for unit in sorted(row)]
    assert sorted(documented) == sorted(expected), "docs/checkpoint.md's layout table names other units"
    position = {unit: i for i, row in enumerate(rows) for unit in row}
    rank = {unit: i for i, row in enumerate(LAYERS) for unit in row}
    for upper in rank:
        for lower in rank:
            if rank[lower] < rank[upper]:
                assert position[upper] <= position[lower], \
                    f"docs/checkpoint.md lists {lower} above {upper}, though {lower} is the lower layer"


@pytest.mark.parametrize("row", LAYERS)
def test_units_of_a_layer_exist(row):
    for unit in row:
        assert os.path.exists(os.path.join(PACKAGE_DIR, unit)) or os.path.exists(
            os.path.join(PACKAGE_DIR, unit + ".py")), unit
