"""Calling a model's own recurrent function on one fragment (a piece of one batch row): shared by the CP = 1 path
(:mod:`.install`) and the state passing between CP ranks (:mod:`.state_passing`)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from .functions import ScanFunction

__all__ = ["bind", "call_fragment", "time_axis"]


def bind(spec: ScanFunction, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name (positional ones named by ``spec.params``)."""
    if len(args) > len(spec.params):
        raise TypeError(f"{spec.name} got {len(args)} positional arguments, blockdiag_cp knows {len(spec.params)}")
    named = dict(zip(spec.params, args))
    named.update(kwargs)
    return named


def time_axis(tensor: torch.Tensor, dim: int) -> int:
    return dim if dim >= 0 else tensor.dim() + dim


def call_fragment(spec: ScanFunction, original: Callable, named: dict[str, Any], row: int, start: int, length: int,
                  initial_state: torch.Tensor | None = None, want_state: bool | None = None,
                  replace: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's own function on rows ``[start, start + length)`` of batch row ``row``: ``(out, final state)``.

    ``want_state``: ask for the final state (default: what the caller asked for). ``replace``: functions applied to
    some of the fragment's inputs (e.g. zeros, to read a state transition off the model's own function).
    """
    sub = dict(named)
    for name, dim in spec.time_args.items():
        value = sub.get(name)
        if isinstance(value, torch.Tensor):
            sub[name] = value[row:row + 1].narrow(time_axis(value, dim), start, length)
    for name, fn in (replace or {}).items():
        sub[name] = fn(sub[name])
    if spec.state_in is not None:
        sub[spec.state_in] = initial_state
    if want_state is not None and spec.state_flag is not None:
        sub[spec.state_flag] = want_state
    result = original(**sub)
    if isinstance(result, tuple):
        return result[0], result[1]
    return result, None
