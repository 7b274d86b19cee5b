"""The tests' own shape: one "each document alone" reference, and no test file reaching into another's helpers."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REFERENCE = TESTS / "reference.py"

# A document run alone through a model (``model(doc[None], use_cache=False)``): the loop of a second copy of
# what tests/reference.py owns (the former copies all had it).
_ALONE_CALL = re.compile(r"\w+\[None\]\s*,\s*use_cache\s*=\s*False\s*\)")


def _test_sources() -> dict[Path, str]:
    return {p: p.read_text() for p in TESTS.rglob("*.py") if p not in (REFERENCE, Path(__file__).resolve())}


def test_documents_alone_is_defined_once():
    copies = [f"{p.relative_to(TESTS)}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0).strip()}"
              for p, text in _test_sources().items() for m in _ALONE_CALL.finditer(text)]
    assert not copies, "use tests/reference.py documents_alone (extend it if needed):\n" + "\n".join(copies)


def test_the_patterns_find_a_copy():
    """The check above can fail: the pattern matches the loop the former copies had, and only the reference."""
    assert _ALONE_CALL.search("logits = [model(d[None], use_cache=False).logits[0] for d in docs]")
    assert _ALONE_CALL.search("ref(doc[None],use_cache=False).logits")
    assert "def documents_alone(" in REFERENCE.read_text()


def _imported_modules(text: str) -> list[str]:
    """Every module an import statement names (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            found += [base] + [f"{base}.{a.name}" if node.module else base + a.name for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return found


def _test_file_imports(text: str) -> list[str]:
    return [m for m in _imported_modules(text) if any(part.startswith("test_") for part in m.split("."))]


def test_no_test_file_imports_another_test_file():
    """Shared harnesses live in non-test modules (tests/reference.py, distributed/fault_harness.py, ...)."""
    found = [f"{p.relative_to(TESTS)} imports {m}" for p in TESTS.rglob("test_*.py")
             for m in _test_file_imports(p.read_text())]
    assert not found, "move the shared helper into a module not named test_*:\n" + "\n".join(found)


def test_the_import_check_sees_each_form():
    assert _test_file_imports("from tests.distributed import test_faults as harness")
    assert _test_file_imports("from tests.training.test_trl_cp import _setup")
    assert _test_file_imports("from .test_faults import FAULTY")
    assert _test_file_imports("import tests.package.test_layout")
    assert not _test_file_imports("from tests.distributed.fault_harness import _run\nimport pytest")
