"""No two modules of hyper_parallel import each other, directly or round a loop: a module can
then always be read (and imported) after the ones it uses. Imports are read with ``ast``,
including those inside functions and under ``TYPE_CHECKING``; nothing is imported. A needed
back-reference is declared as a contract in the lower module (e.g. a Protocol) instead. Every
package's docstring says what it may import."""

from __future__ import annotations

import ast
import os
from typing import Dict, Set

import pytest

from tests.import_graph import cycles, module_graph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def library_graph() -> Dict[str, Set[str]]:
    return module_graph(ROOT, "hyper_parallel")


def test_no_import_cycle_in_the_library(library_graph):
    graph = library_graph
    assert {"hyper_parallel.core.fully_shard.state", "hyper_parallel.models"} <= set(graph)
    assert cycles(graph) == []


def test_a_lazy_import_closing_a_circle_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\n"
                                          "if TYPE_CHECKING:\n    from ..c import C\n")
    (package / "c.py").write_text("def f():\n    from pkg import a\n    return a\n")
    (package / "d.py").write_text("import pkg.a\nfrom pkg.sub.b import x\n")  # outside the circle
    graph = module_graph(str(tmp_path), "pkg")
    assert graph["pkg.d"] == {"pkg.a", "pkg.sub.b"}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


# What the package docstrings (hyper_parallel/<package>/__init__.py) say each package may import.
MAY_IMPORT = {
    "hyper_parallel.models": ("hyper_parallel.models", "hyper_parallel._torch_compat", "hyper_parallel.core",
                              "hyper_parallel.checkpoint", "hyper_parallel.parallel.context",
                              "hyper_parallel.parallel.ring_attention", "hyper_parallel.parallel.expert",
                              "hyper_parallel.chunked_loss",
                              "hyper_parallel._optional", "hyper_parallel.utils"),
    "hyper_parallel.parallel": ("hyper_parallel.parallel", "hyper_parallel._torch_compat", "hyper_parallel.core",
                                "hyper_parallel.chunked_loss", "hyper_parallel.utils"),
}


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_a_package_imports_only_what_its_docstring_allows(library_graph, package):
    allowed = MAY_IMPORT[package]
    assert package in library_graph
    outside = sorted(f"{module} imports {imported}" for module, imports in library_graph.items()
                     if module == package or module.startswith(package + ".") for imported in imports
                     if not (imported in allowed or imported.startswith(tuple(a + "." for a in allowed))))
    assert outside == []


def test_every_package_says_what_it_may_import():
    """Each package's docstring names what it holds and what it may import (a newcomer's map)."""
    silent = []
    for folder, _, files in os.walk(os.path.join(ROOT, "hyper_parallel")):
        if "__init__.py" in files:
            with open(os.path.join(folder, "__init__.py")) as f:
                if "May import" not in (ast.get_docstring(ast.parse(f.read())) or ""):
                    silent.append(os.path.relpath(folder, ROOT))
    assert not silent, f"packages whose docstring does not say what they may import: {silent}"
