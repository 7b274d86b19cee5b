"""One exception root for refusals: every refusal the package raises is a :class:`~hf_blockdiag_cp.errors.Refusal`,
both a ``BlockDiagCPError`` and a ``NotImplementedError``, so ``except BlockDiagCPError`` catches every one. The
package's raises are read with ``ast``: none raises a bare ``NotImplementedError`` outside errors.py."""

from __future__ import annotations

import ast
import pathlib

import hf_blockdiag_cp as bd
from hf_blockdiag_cp import errors

PACKAGE = pathlib.Path(bd.__file__).parent


def bare_refusals(source: str) -> list[int]:
    """Line numbers of the ``raise`` statements of ``source`` that raise the built-in ``NotImplementedError``
    (called or not, also picked by an expression: ``raise (NotImplementedError if c else E)(m)``)."""
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Raise) and node.exc
            is not None and any(isinstance(n, ast.Name) and n.id == "NotImplementedError" for n in ast.walk(node.exc))]


def test_the_walk_finds_planted_bare_refusals():
    planted = ("def f(c):\n    raise NotImplementedError('x')\n\ndef g():\n    raise NotImplementedError\n\n"
               "def h(c):\n    raise (NotImplementedError if c else RuntimeError)('y')\n\n"
               "def k():\n    raise Refusal('z')\n")
    assert bare_refusals(planted) == [2, 5, 8]


def test_no_module_raises_a_bare_not_implemented_error():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             if path.name != "errors.py" for line in bare_refusals(path.read_text())]
    assert found == [], ("raise hf_blockdiag_cp.errors.Refusal (or a subclass) instead of NotImplementedError, so "
                         "that `except BlockDiagCPError` catches every refusal: " + ", ".join(found))


def test_refusal_is_both_roots_and_every_refusal_class_is_one():
    assert issubclass(errors.Refusal, errors.BlockDiagCPError)
    assert issubclass(errors.Refusal, NotImplementedError)
    refusals = [getattr(errors, name) for name in errors.__all__
                if issubclass(getattr(errors, name), NotImplementedError)]
    assert {cls.__name__ for cls in refusals} >= {"Refusal", "UnsupportedModel", "BackendUnavailable",
                                                   "MaskConsumedError"}
    assert all(issubclass(cls, errors.Refusal) for cls in refusals), refusals
    try:
        raise errors.Refusal("a refusal")
    except errors.BlockDiagCPError as err:  # the point: one except clause catches every refusal
        assert isinstance(err, NotImplementedError) and str(err) == "a refusal"
