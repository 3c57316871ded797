"""import-linter contract types of our own (registered in pyproject.toml, run by ``make test``).

- ``private_names``: a module never imports a ``_private`` name (or module) from another package
  (its own package's modules may share them).
- ``acyclic``: no import cycle between modules of the root package, at any depth.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import lru_cache

from importlinter import Contract, ContractCheck, fields, output


@lru_cache(maxsize=None)
def _imports_by_line(module: str) -> dict[int, list[str]]:
    """``{line: [names]}`` of every ``from X import names`` in ``module``'s source."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return {}
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    out: dict[int, list[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            out.setdefault(node.lineno, []).extend(alias.name for alias in node.names)
    return out


def _package(module: str) -> str:
    """The package a module belongs to (itself for a package's ``__init__``: we cannot tell them apart here,
    so a package and its direct modules count as one)."""
    return module.rpartition(".")[0]


def _same_package(a: str, b: str) -> bool:
    return _package(a) == _package(b) or _package(a) == b or a == _package(b)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


class PrivateNamesContract(Contract):
    """No ``_private`` name (module or attribute) is imported from another package under ``root``."""

    root = fields.StringField()

    def check(self, graph, verbose: bool) -> ContractCheck:
        broken = []
        for importer in sorted(graph.modules):
            if not importer.startswith(self.root):
                continue
            for imported in sorted(graph.find_modules_directly_imported_by(importer)):
                if not imported.startswith(self.root) or _same_package(importer, imported):
                    continue
                if any(_private(part) for part in imported.split(".")):
                    broken.append(f"{importer} imports the private module {imported}")
                    continue
                for detail in graph.get_import_details(importer=importer, imported=imported):
                    names = _imports_by_line(importer).get(detail["line_number"], [])
                    for name in names:
                        if _private(name):
                            broken.append(f"{importer}:{detail['line_number']} imports {imported}.{name}")
        return ContractCheck(kept=not broken, metadata={"broken": broken})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for line in check.metadata["broken"]:
            output.print_error(line)
            output.new_line()


class AcyclicContract(Contract):
    """No import cycle between the modules under ``root`` (type-checking imports included)."""

    root = fields.StringField()

    def check(self, graph, verbose: bool) -> ContractCheck:
        modules = sorted(m for m in graph.modules if m.startswith(self.root))
        edges = {m: sorted(i for i in graph.find_modules_directly_imported_by(m) if i.startswith(self.root))
                 for m in modules}
        cycles = [c for c in _strongly_connected(modules, edges) if len(c) > 1]
        return ContractCheck(kept=not cycles, metadata={"cycles": cycles})

    def render_broken_contract(self, check: ContractCheck) -> None:
        for cycle in check.metadata["cycles"]:
            output.print_error("import cycle: " + " <-> ".join(sorted(cycle)))
            output.new_line()


def _strongly_connected(nodes: list[str], edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            successors = edges.get(node, [])
            if i < len(successors):
                work.append((node, i + 1))
                nxt = successors[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            for succ in successors:
                if succ in on_stack:
                    low[node] = min(low[node], low[succ])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                components.append(component)
    return components
