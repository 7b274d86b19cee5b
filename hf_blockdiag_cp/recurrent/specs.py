"""How a served recurrent call is made: neutral descriptions of a function's or module's parameters.

These say where the time axes are, which parameter takes the initial state and which asks for the final one, and the
recurrence's kind (:class:`~.kinds.MixerKind`); which transformers functions and classes they describe is listed by
the integration layer (:mod:`hf_blockdiag_cp.mixer_table`), not here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .algebra import StateAlgebra
from .kinds import MixerKind

__all__ = ["ScanFunction", "ScanModule", "StatefulModule", "WindowedModule", "bind", "time_axis"]


def time_axis(tensor: torch.Tensor, dim: int) -> int:
    """``dim`` as a non-negative axis of ``tensor``."""
    return dim if dim >= 0 else tensor.dim() + dim


def bind(params: tuple[str, ...], name: str, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments by name (positional ones named by ``params``)."""
    if len(args) > len(params):
        raise TypeError(f"{name} got {len(args)} positional arguments, blockdiag_cp knows {len(params)}")
    named = dict(zip(params, args))
    named.update(kwargs)
    return named


@dataclass(frozen=True)
class ScanFunction:
    """How one replaceable sequence mixer is called (names as in transformers 5.25).

    Attributes:
        name: the kernel layer name (the key in ``mixer._kernel_funcs``).
        params: its leading parameters in order (to bind positional arguments).
        time_args: parameters with a time axis, and that axis (negative: counted from the end).
        out_dim: the time axis of the output.
        state_in: the initial-state parameter (``None``: the function takes none).
        state_flag: the parameter asking for the final state.
        returns_tuple: the output is always ``(out, state)``; otherwise a tuple only when ``state_flag`` is true.
        kind: the recurrence (:class:`~.kinds.MixerKind`).
    """

    name: str
    params: tuple[str, ...]
    time_args: dict[str, int]
    out_dim: int
    state_in: str | None
    state_flag: str | None
    returns_tuple: bool
    kind: MixerKind


@dataclass(frozen=True)
class WindowedModule:
    """A module that mixes tokens with a plain ``nn.Conv1d`` (no replaceable function): its output at ``t`` depends
    on its inputs at ``t - window .. t`` only, so it is served as a whole, once per fragment (the instance
    ``forward`` is replaced, as for the wrappers). A fragment that continues a document gets the document's last
    ``window`` earlier inputs (fewer at its start) prepended, from the CP ranks that hold them; their outputs are
    dropped.

    Attributes:
        name: the module's class name (transformers 5.25); with ``child``, the class of the module holding it.
        params: its ``forward``'s parameters in order (to bind positional arguments).
        sequence: the input ``[B, T, C]`` (time axis 1) or ``[B, C, T]`` (``time_dim=-1``); every output has its
            time axis at ``time_dim``, and its first ``T`` steps are the outputs of the ``T`` inputs.
        mask: an optional padding mask ``[B, T]`` sliced with the sequence.
        cache: the cache parameter (must be ``None`` with packed rows), if any.
        window_attr: the module attribute holding how many earlier inputs an output reads (at least 1); ``None``
            for a plain ``nn.Conv1d`` (:func:`conv_window`).
        child: the served module is this plain ``nn.Conv1d`` attribute of the ``name`` module, not that module.
        time_dim: the time axis of the sequence and the outputs (1 or -1).
        owner_reads: for a ``child``: the expression in the owner's ``forward`` that reads the child's output. A
            served child returns the ``T`` outputs of its ``T`` inputs only (a padded ``nn.Conv1d`` returns more),
            which is all this expression reads; checked against the owner's source by the tests.
    """

    name: str
    params: tuple[str, ...]
    sequence: str
    mask: str | None
    cache: str | None
    window_attr: str | None
    child: str | None = None
    time_dim: int = 1
    owner_reads: str | None = None


@dataclass(frozen=True)
class ScanModule:
    """A module that is one recurrent scan taking its initial state as arguments (xLSTM's mLSTM backend): served
    once per fragment by an instance ``forward``, a continuing fragment from its composed incoming state
    (:class:`~.module_runners.ScanModuleRunner`).

    Attributes:
        name: the module's class name (transformers 5.25).
        params: its ``forward``'s parameters in order (to bind positional arguments).
        time_args: parameters with a time axis, and that axis; the output ``h`` has its time axis at ``out_dim``.
        out_dim: the output's time axis.
        state_in: the initial-state parameters, in the order the module returns its last states.
        state_flag: the parameter asking for the last states (the module returns ``(h, states)`` then).
        algebra: the call's :class:`~.algebra.StateAlgebra` from its arguments by name.
        transition: a fragment's transition parts from the call's arguments and the fragment.
        returns_states: whether a call returns its last states, from the module and the call's arguments (default:
            the ``state_flag`` argument).
    """

    name: str
    params: tuple[str, ...]
    time_args: dict[str, int]
    out_dim: int
    state_in: tuple[str, ...]
    state_flag: str
    algebra: Callable[[dict[str, Any]], StateAlgebra]
    transition: Callable[[dict[str, Any], Any], tuple[torch.Tensor, ...]]
    returns_states: Callable[[Any, dict[str, Any]], bool] | None = None


@dataclass(frozen=True)
class StatefulModule:
    """A token mixer whose linear recurrence runs inside its own ``forward`` (no replaceable function or method), all
    else in it per token. Served whole, once per fragment (the instance ``forward`` is replaced): without a cache the
    forward starts from a zero state and returns ``(out, end state)``; a fragment that continues a document runs with
    a stand-in cache that hands it the composed incoming state (the forward's own cached path, token by token).

    Attributes:
        name: the module's class name (transformers 5.25).
        params: its ``forward``'s parameters in order (to bind positional arguments).
        sequence: the input ``[B, T, C]`` (time axis 1); the output ``[B, T, C]`` too.
        time_args: other parameters with a time axis at 1, tensors or tuples of tensors (rotary ``(cos, sin)``,
            a padding mask), sliced with the sequence.
        cache: the cache parameter; the stand-in is passed there. With packed rows a given cache must hold no state
            for the layer yet (a prefill, e.g. ``generate()`` on left-padded rows, CP = 1): it then gets the end
            state of each row's last fragment, as the stock forward leaves it.
        cache_get / cache_set: the cache's methods the forward reads and writes its state with (``(layer_idx)``,
            ``(layer_idx, state)``).
        layer_attr: the module attribute holding its layer index.
        heads_attr / dim_attr: module attributes giving the state ``[H, D, D]``.
        rate_attr: module buffer ``[H, ...]`` of the per-token decay rate: the state decays by ``exp(-rate)`` a token.
    """

    name: str
    params: tuple[str, ...]
    sequence: str
    time_args: tuple[str, ...]
    cache: str
    cache_get: str
    cache_set: str
    layer_attr: str
    heads_attr: str
    dim_attr: str
    rate_attr: str
