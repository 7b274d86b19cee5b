"""The package's imports go one way: ``attention/`` knows nothing of ``model/``, and no modules import each
other in a circle (lazy imports inside functions included: a cycle there is still a cycle of knowledge).

Read with ``ast`` from the source files, so the test needs no import of the package and fails on the edge itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hf_blockdiag_cp"
NAME = PACKAGE.name


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package is its ``__init__``)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from .x import y`` counts ``x.y`` when that is a module)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)] + ([node.module] if node.module else [])
                    source = ".".join(base)
                else:
                    source = node.module or ""
                if source.split(".")[0] != NAME:
                    continue
                for alias in node.names:
                    candidate = f"{source}.{alias.name}"
                    targets.add(candidate if candidate in modules else source)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.split(".")[0] == NAME)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_attention_imports_nothing_from_model():
    graph = import_graph()
    bad = {m: sorted(t for t in ts if t.startswith(f"{NAME}.model"))
           for m, ts in graph.items() if m.startswith(f"{NAME}.attention")}
    assert not {m: ts for m, ts in bad.items() if ts}, "attention/ must not import model/ (use integration.py)"


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_checks_can_fail():
    """The graph sees lazy and relative imports, and the cycle finder finds a circle."""
    graph = import_graph()
    assert f"{NAME}.attention.core" in graph[f"{NAME}.integration"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
