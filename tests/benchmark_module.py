"""Load a script of ``benchmarks/`` as a module (they are scripts, not a package): the tests reuse their row
generators and baselines."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
