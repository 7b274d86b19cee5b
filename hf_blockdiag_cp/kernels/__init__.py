"""Attention kernel backends behind one contract (see :mod:`.base`) and their selection.

A backend is one module with ``NAME``, ``CAPABILITIES`` (a :class:`~.base.Capabilities`: devices, dtypes,
features, its rank for ``backend="auto"``) and ``attention(q, k, v, call)``. Availability checks, the
``"auto"`` preference order and the names the configuration accepts are all derived from the capabilities;
:func:`register_backend` adds one (the built-in ones are registered below).
"""

from __future__ import annotations

import functools
import warnings
from types import ModuleType

from ..config import BUILTIN_BACKENDS, add_backend_name
from . import flash, flex, sdpa_doc, sdpa_mask, te, torch_varlen
from .base import BackendUnavailable, Capabilities, KernelCall, KernelSpec

__all__ = [
    "BackendUnavailable",
    "Capabilities",
    "KernelCall",
    "KernelSpec",
    "auto_order",
    "available_backends",
    "backend_names",
    "choose_backend",
    "get_backend",
    "register_backend",
    "unavailable_reason",
]

#: Every registered backend by name (the registry's one owner is :func:`register_backend`).
_BACKENDS: dict[str, ModuleType] = {}


def register_backend(module: ModuleType) -> None:
    """Make ``module`` a backend: it has ``NAME``, ``CAPABILITIES`` and ``attention(q, k, v, call)``.

    Register it before any context or config names it, on every rank alike (the ranks' agreement sends one
    bit per registered backend, in registration order).
    """
    caps = getattr(module, "CAPABILITIES", None)
    if not isinstance(caps, Capabilities) or caps.name != getattr(module, "NAME", None):
        raise TypeError(f"a backend module needs NAME and CAPABILITIES = Capabilities(NAME, ...), got {module!r}")
    if not callable(getattr(module, "attention", None)):
        raise TypeError(f"backend {caps.name!r} has no attention(q, k, v, call) function")
    _BACKENDS[caps.name] = module
    add_backend_name(caps.name)
    auto_order.cache_clear()


def backend_names() -> tuple[str, ...]:
    """The registered backends, in registration order (``"auto"`` excluded)."""
    return tuple(_BACKENDS)


@functools.lru_cache(maxsize=None)
def auto_order(device_type: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(preferred, last_resort)`` backend names for ``backend="auto"`` on ``device_type``, from the
    capabilities (flex and sdpa_mask are never preferred, only taken as a last resort)."""
    caps = [m.CAPABILITIES for m in _BACKENDS.values()]
    key = device_type if any(device_type in c.auto for c in caps) else "default"
    preferred = sorted((c.auto[key], c.name) for c in caps if key in c.auto)
    last = sorted((c.last_resort, c.name) for c in caps if c.last_resort is not None)
    return tuple(n for _, n in preferred), tuple(n for _, n in last)


for _module in (flash, te, torch_varlen, flex, sdpa_doc, sdpa_mask):
    register_backend(_module)
assert set(_BACKENDS) == set(BUILTIN_BACKENDS) - {"auto"}, "config.BUILTIN_BACKENDS names the built-in backends"


def get_backend(name: str) -> ModuleType:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"backend={name!r} is not one of auto, {', '.join(_BACKENDS)}") from None


def unavailable_reason(name: str, spec: KernelSpec) -> str | None:
    """Why backend ``name`` cannot run ``spec`` (cheap: imports, device, dtype, features), or ``None``."""
    return get_backend(name).CAPABILITIES.unavailable_reason(spec)


def available_backends(spec: KernelSpec, disabled: tuple[str, ...] = ()) -> frozenset[str]:
    """Every backend that can run ``spec`` on this process, minus the ``disabled`` ones."""
    return frozenset(name for name in _BACKENDS if name not in disabled and unavailable_reason(name, spec) is None)


def choose_backend(requested: str, spec: KernelSpec, available: frozenset[str] | None = None) -> tuple[str, str | None]:
    """Pick the backend for ``spec``.

    Args:
        requested: ``"auto"`` or a registered backend's name.
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
    if requested != "auto" and requested not in _BACKENDS:
        raise ValueError(f"backend={requested!r} is not one of auto, {', '.join(_BACKENDS)}")
    if available is None:
        available = available_backends(spec)
    note = None
    if requested != "auto":
        if requested in available:
            return requested, None
        reason = unavailable_reason(requested, spec) or "not available on every rank"
        note = f"blockdiag_cp backend {requested!r} cannot run this call ({reason}); falling back"
    preferred, last_resort = auto_order(spec.device_type)
    for name in preferred + last_resort:
        if name in available:
            if note is None and name in last_resort:
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
