"""Argument checks shared by the public constructors (host-side, raised before any work)."""

from __future__ import annotations

from typing import Any

__all__ = ["check_int"]


def check_int(name: str, value: Any, *, minimum: int | None = None, below: tuple[str, int] | None = None,
              hint: str | None = None) -> int:
    """Return ``value`` if it is an ``int`` (``bool`` is refused) within bounds, else raise ``ValueError``.

    Args:
        name: the argument's name, quoted as ``name=value`` in the message.
        value: the value to check.
        minimum: inclusive lower bound.
        below: exclusive upper bound as ``(what, bound)``, quoted as ``what=bound``
            (``cp_rank=2 must be an int in [0, cp_size=2)``).
        hint: appended to the message in parentheses (where the right value usually comes from).
    """
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if is_int and (minimum is None or value >= minimum) and (below is None or value < below[1]):
        return value
    if minimum is not None and below is not None:
        wanted = f"an int in [{minimum}, {below[0]}={below[1]})"
    elif minimum is not None:
        wanted = f"an int >= {minimum}"
    elif below is not None:
        wanted = f"an int < {below[0]}={below[1]}"
    else:
        wanted = "an int"
    raise ValueError(f"{name}={value!r} must be {wanted}" + (f" ({hint})" if hint else ""))
