"""A package's imports read with ``ast``, nothing imported: every ``import`` statement counts,
those inside functions and under ``if TYPE_CHECKING:`` too (a lazy import is still a
dependency). Shared by the layer tests and the import-cycle test."""

from __future__ import annotations

import ast
import importlib.util
import os
from typing import Dict, Iterator, List, Sequence, Set, Tuple


def imported_names(path: str, module: str) -> Iterator[str]:
    """Every dotted name the file ``path`` (module ``module``) imports; ``from a import b``
    gives ``a.b`` (``b`` a submodule of ``a`` or a name defined in ``a``)."""
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative to the module's package
                package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
                base = importlib.util.resolve_name("." * node.level + base, package)
            yield from (f"{base}.{alias.name}" for alias in node.names)


def package_modules(root: str, package: str) -> Dict[str, str]:
    """module name -> file, for every module of ``package`` (a folder under ``root``); a
    package's ``__init__.py`` is the module of the package's own name."""
    modules = {}
    for folder, _, files in os.walk(os.path.join(root, *package.split("."))):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                modules[dotted.removesuffix(".__init__")] = path
    return modules


def module_graph(root: str, package: str) -> Dict[str, Set[str]]:
    """module -> the modules of ``package`` it imports. A name stands for the longest module it
    names (``from a import b``: ``a.b`` if that is a module, else ``a``); the packages above an
    imported module are not counted (each package's ``__init__`` would otherwise close a circle
    with every module below it that imports a sibling)."""
    modules = package_modules(root, package)

    def module_of(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph: Dict[str, Set[str]] = {}
    for module, path in modules.items():
        named = {module_of(name) for name in imported_names(path, module)}
        graph[module] = {m for m in named if m and m != module}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The import circles of ``graph``: each set of two or more modules that import one another
    (directly or round a loop; a strongly connected component), sorted, smallest name first."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(start: str) -> None:  # Tarjan's algorithm, iterative (no recursion limit)
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph.get(successor, ())))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def unit_graph(root: str, package: str) -> Dict[str, Set[Tuple[str, str]]]:
    """unit -> {(imported unit, importing file)} over ``package``'s files (not its face, its
    ``__init__.py``), a unit being a subpackage or top-level module of it
    (``package.filesystem.writer`` is in unit ``filesystem``)."""
    package_dir = os.path.join(root, *package.split("."))

    def unit(module: str) -> str:
        return module[len(package) + 1:].split(".")[0]

    graph: Dict[str, Set[Tuple[str, str]]] = {}
    for module, path in package_modules(root, package).items():
        if module == package:
            continue
        graph.setdefault(unit(module), set())
        for imported in imported_names(path, module):
            if imported.startswith(package + ".") and unit(imported) != unit(module):
                graph[unit(module)].add((unit(imported), os.path.relpath(path, package_dir)))
    return graph


def unit_layer_violations(graph: Dict[str, Set[Tuple[str, str]]], layers: Sequence[Tuple[str, ...]],
                          placing: str) -> List[str]:
    """Each import of ``graph`` (:func:`unit_graph`) that does not run to a lower row of
    ``layers`` (bottom to top), and each unit no row places (``placing``: where to place it)."""
    rank = {unit: i for i, row in enumerate(layers) for unit in row}
    problems = [f"{unit} is in no layer: {placing}" for unit in graph if unit not in rank]
    for unit, edges in sorted(graph.items()):
        for imported, path in sorted(edges):
            if unit in rank and imported in rank and rank[imported] >= rank[unit]:
                where = "its own layer" if rank[imported] == rank[unit] else "a higher layer"
                problems.append(f"{path} imports {imported}, which is in {where} than {unit}")
    return problems
