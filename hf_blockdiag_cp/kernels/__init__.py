"""Attention kernel backends behind one contract (see :mod:`.base`) and their selection.

Adding a backend is one new module (``NAME``, ``unavailable_reason``, ``attention``) and one line
in :data:`_BACKENDS`.
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType

from ..config import BACKENDS
from . import flash, flex, sdpa_doc, sdpa_mask, te, torch_varlen
from .base import BackendUnavailable, KernelCall, KernelSpec

__all__ = [
    "AUTO_ORDER",
    "BackendUnavailable",
    "KernelCall",
    "KernelSpec",
    "available_backends",
    "choose_backend",
    "get_backend",
    "unavailable_reason",
]

_BACKENDS: dict[str, ModuleType] = {m.NAME: m for m in (flash, te, torch_varlen, flex, sdpa_doc, sdpa_mask)}
assert set(_BACKENDS) == set(BACKENDS) - {"auto"}

#: Preference of ``"auto"`` per device type (flex and sdpa_mask are never picked automatically).
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("flash", "te", "torch_varlen", "sdpa_doc"),
    "default": ("sdpa_doc",),
}
#: Tried after the preferred backends when none of them can run (e.g. softcap on CPU inference).
_LAST_RESORT: tuple[str, ...] = ("flex", "sdpa_mask")


def get_backend(name: str) -> ModuleType:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend={name!r} is not one of {', '.join(BACKENDS)}") from None


def unavailable_reason(name: str, spec: KernelSpec) -> str | None:
    """Why backend ``name`` cannot run ``spec`` (cheap: imports, device, dtype, features), or ``None``."""
    return get_backend(name).unavailable_reason(spec)


def available_backends(spec: KernelSpec, disabled: tuple[str, ...] = ()) -> frozenset[str]:
    """Every backend that can run ``spec`` on this process, minus the ``disabled`` ones."""
    return frozenset(name for name in _BACKENDS if name not in disabled and unavailable_reason(name, spec) is None)


def choose_backend(requested: str, spec: KernelSpec, available: frozenset[str] | None = None) -> tuple[str, str | None]:
    """Pick the backend for ``spec``.

    Args:
        requested: a name from :data:`~hf_blockdiag_cp.config.BACKENDS`.
        spec: what the call needs.
        available: backends every participating rank can run (the result of the rank agreement);
            defaults to this process's :func:`available_backends`. The choice is a pure function of
            ``(requested, spec.device_type, available)``, so ranks that agree on ``available`` agree
            on the backend.

    Returns:
        ``(name, note)`` where ``note`` explains a fallback from an explicitly requested backend.
        When ``"auto"`` has to take a last-resort backend (``flex``, ``sdpa_mask``: slow, dense
        masks) because no preferred one can run, typically because one CP rank disabled ``sdpa_doc``,
        a ``UserWarning`` says so once per process and cause (the choice itself stays a pure function).

    Raises:
        ValueError: unknown ``requested``.
        BackendUnavailable: no backend can compute this call exactly.
    """
    if requested not in BACKENDS:
        raise ValueError(f"backend={requested!r} is not one of {', '.join(BACKENDS)}")
    if available is None:
        available = available_backends(spec)
    note = None
    if requested != "auto":
        if requested in available:
            return requested, None
        reason = unavailable_reason(requested, spec) or "not available on every rank"
        note = f"blockdiag_cp backend {requested!r} cannot run this call ({reason}); falling back"
    preferred = AUTO_ORDER.get(spec.device_type, AUTO_ORDER["default"])
    for name in preferred + _LAST_RESORT:
        if name in available:
            if note is None and name in _LAST_RESORT:
                _warn_last_resort(name, "; ".join(f"{n}: {_why_not(n, spec)}" for n in preferred))
            return name, (f"{note} to {name!r}" if note else None)
    reasons = "; ".join(f"{n}: {unavailable_reason(n, spec) or 'unavailable on another rank'}" for n in _BACKENDS)
    raise BackendUnavailable(f"no blockdiag_cp backend can compute this attention exactly ({reasons})")


def _why_not(name: str, spec: KernelSpec) -> str:
    return unavailable_reason(name, spec) or ("disabled on this process (disabled_backends, env "
                                              "HF_BLOCKDIAG_CP_DISABLE_BACKENDS) or on another CP rank")


@functools.lru_cache(maxsize=None)  # the cache is the "once": one warning per process and cause
def _warn_last_resort(name: str, reasons: str) -> None:
    warnings.warn(f"blockdiag_cp backend 'auto' fell back to the last-resort {name!r} (exact, but slow with "
                  f"dense per-document masks) because no preferred backend can run this call on every rank "
                  f"({reasons})", UserWarning, stacklevel=4)
