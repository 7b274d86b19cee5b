"""The package's shape: one-way imports between subpackages, lazy Trainer, no repeated blocks."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hf_blockdiag_cp"


def _unit(module: str) -> str:
    """The subpackage (or top-level module) a dotted module name of the package belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """``unit -> units it imports`` over every import of the package's modules (module level or not,
    ``TYPE_CHECKING`` blocks excluded: they never run)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING") for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                    targets = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
                else:
                    targets = [node.module or ""]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                if target == "hf_blockdiag_cp" or target.startswith("hf_blockdiag_cp."):
                    src, dst = _unit(name), _unit(target)
                    if src != dst and dst != "__init__":
                        graph[src].add(dst)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of nodes, or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_subpackages_import_each_other_one_way():
    graph = import_graph()
    assert graph, "the import walk found no imports at all"
    assert "distributed" in graph["attention"], graph  # the walk sees relative imports
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle between subpackages: {' -> '.join(cycle)}"
    # distributed/ holds collectives only: it knows no attention, context, data or training code.
    assert not graph["distributed"] & {"attention", "context", "data", "training", "kernels"}, graph["distributed"]
    assert not graph["planning"] & {"attention", "context", "data", "training", "kernels", "distributed"}


def test_no_function_local_imports_of_the_package_or_required_dependencies():
    optional = {"flash_attn", "transformer_engine", "datasets", "trl", "peft"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        for func in ast.walk(ast.parse(path.read_text())):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.ImportFrom):
                    names = [("." * node.level) + (node.module or "")]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for name in names:
                    if name.split(".")[0] not in optional and name != "importlib":
                        found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} imports {name}")
    assert not found, "\n".join(found)


@pytest.mark.slow
def test_import_does_not_load_the_trainer():
    code = ("import sys, hf_blockdiag_cp as bd; assert 'transformers.trainer' not in sys.modules, 'eager'; "
            "bd.CPTrainer; assert 'transformers.trainer' in sys.modules; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


_SKIP = re.compile(r"^(#.*|[\s()\[\]{},:]*|(from|import)\s.*|\"\"\"|@.*)$")


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """``(line number, normalised text)`` of the lines that carry code (no blanks, comments,
    imports, docstring quotes, decorators or lone punctuation)."""
    out = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        text = " ".join(raw.split())
        if not _SKIP.match(text):
            out.append((number, text))
    return out


def repeated_blocks(paths: list[Path], size: int = 6) -> list[str]:
    """Every run of ``size`` code lines that stands, identically, in two places."""
    seen: dict[tuple[str, ...], str] = {}
    found = []
    for path in paths:
        lines = _code_lines(path)
        last_hit = -size
        for i in range(len(lines) - size + 1):
            block = tuple(text for _, text in lines[i:i + size])
            where = f"{path.relative_to(PACKAGE.parent)}:{lines[i][0]}"
            if block in seen and i >= last_hit + size:
                found.append(f"{where} repeats {seen[block]}")
                last_hit = i
            seen.setdefault(block, where)
    return found


def test_repeated_block_finder_finds_a_planted_copy(tmp_path):
    body = "\n".join(f"x{i} = compute({i}) + {i}" for i in range(8))
    (tmp_path / "a.py").write_text(body)
    (tmp_path / "b.py").write_text("y = 1\n" + body)
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path
    try:
        assert len(repeated_blocks(sorted(tmp_path.glob("*.py")))) == 1
    finally:
        PACKAGE = saved


def test_no_block_of_six_lines_is_repeated_in_the_package():
    found = repeated_blocks(sorted(PACKAGE.rglob("*.py")))
    assert not found, "\n".join(found)
