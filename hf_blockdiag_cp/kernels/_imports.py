"""Lazy, cached imports of optional kernel libraries (flash-attn, transformer-engine).

Importing this package never imports them; the first availability check does, once per process.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from types import ModuleType

__all__ = ["optional_import"]


@functools.lru_cache(maxsize=None)
def _import(name: str) -> tuple[ModuleType | None, str | None]:
    if name in sys.modules:  # already imported (or a test's stand-in)
        return sys.modules[name], None
    if importlib.util.find_spec(name.split(".")[0]) is None:
        return None, f"{name} is not installed"
    try:
        return importlib.import_module(name), None
    except Exception as err:  # a broken CUDA build raises all sorts of errors at import
        return None, f"{name} failed to import: {type(err).__name__}: {err}"


def optional_import(name: str) -> tuple[ModuleType | None, str | None]:
    """``(module, None)`` or ``(None, reason)``; cached, so tests that swap modules call ``cache_clear``."""
    return _import(name)


optional_import.cache_clear = _import.cache_clear  # type: ignore[attr-defined]
