"""The public surface: a short ``__all__``, one exception base, and every exception class defined in errors.py."""

from __future__ import annotations

import ast
import pathlib

import hf_blockdiag_cp as bd
from hf_blockdiag_cp import errors

PACKAGE = pathlib.Path(bd.__file__).parent


def test_all_is_short_and_importable():
    assert len(bd.__all__) <= 30, len(bd.__all__)
    assert len(set(bd.__all__)) == len(bd.__all__)
    for name in bd.__all__:
        getattr(bd, name)
    for name in ("prepare_model", "UnsupportedModel", "comm_stats", "BlockDiagCPError"):
        assert name in bd.__all__
    for internal in ("VarlenPlan", "build_varlen_plan", "BlockDiagMask"):
        assert not hasattr(bd, internal), f"{internal} is a planning internal (import it from its module)"


def test_every_exception_has_one_base_and_keeps_its_builtin_base():
    builtin = {"PlanError": ValueError, "ExchangeSizeError": ValueError, "UnsupportedModel": NotImplementedError,
               "BackendUnavailable": NotImplementedError, "MaskConsumedError": NotImplementedError,
               "Refusal": NotImplementedError,
               "AgreementError": RuntimeError, "CollectiveError": RuntimeError, "CPKernelError": RuntimeError,
               "ParameterMismatchError": RuntimeError}
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.BlockDiagCPError)
    assert set(errors.__all__) == set(builtin) | {"BlockDiagCPError"}
    for name, base in builtin.items():
        assert issubclass(getattr(errors, name), base), name


def test_exception_classes_are_defined_only_in_errors_py():
    found = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and (b.id.endswith(("Error", "Exception")) or b.id in
                                                 ("NotImplementedError", "BackendUnavailable", "UnsupportedModel"))
                    for b in node.bases):
                found.append(f"{path.relative_to(PACKAGE)}:{node.name}")
    assert found == [], "define package exceptions in hf_blockdiag_cp/errors.py under BlockDiagCPError"


def test_head_shape_is_exported_and_model_preparation_has_one_name():
    import torch

    from hf_blockdiag_cp.model.prepare import PREPARATION_ATTR

    assert "HeadShape" in bd.__all__  # error messages tell users to pass heads=HeadShape(...)
    assert "prepare_model" in bd.__all__ and "guard_model" not in bd.__all__
    # guard_model stays importable: the alias of prepare_model(model, strict=True), nothing more.
    strict, plain, guarded = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    assert bd.prepare_model(strict, strict=True) is strict and bd.guard_model(guarded) is guarded
    bd.prepare_model(plain)
    assert guarded.__dict__[PREPARATION_ATTR].strict and strict.__dict__[PREPARATION_ATTR].strict
    assert not plain.__dict__[PREPARATION_ATTR].strict


def test_readme_runs_the_check_through_its_module():
    readme = (PACKAGE.parent / "README.md").read_text()
    assert "python -m hf_blockdiag_cp.conformance MODEL" in readme
    assert (PACKAGE / "conformance" / "__main__.py").is_file()
    # check.py is only the earlier name: an entry point that calls the conformance command line, nothing else.
    shim = ast.parse((PACKAGE / "check.py").read_text())
    assert [type(node).__name__ for node in shim.body] == ["Expr", "If"], "check.py holds no code of its own"
