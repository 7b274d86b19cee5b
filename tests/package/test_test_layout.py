"""The tests' own shape: one "each document alone" reference."""

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

