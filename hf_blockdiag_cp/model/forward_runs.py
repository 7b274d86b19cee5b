"""Which packed forward an activation-checkpoint recompute belongs to: its fragments travel with it.

The model's pre-hook plans the fragments of the forward's rows (:func:`~hf_blockdiag_cp.recurrent.runs.local_runs`)
and the :class:`~.prepare.ForwardState` holds them (with the forward's packed ``position_ids`` and ``cp_context``)
while the forward runs and after it. transformers 5.25 checkpoints a layer's ``forward`` (not its ``__call__``): the
backward's recompute re-runs the layer's children without the layer's hooks, so nothing in the recompute itself says
which forward it belongs to, and the state then holds the LATEST forward's. That is silently wrong when two packed
forwards wait for one backward (DPO's chosen / rejected, summed micro-batches).

So the forward state travels with the recompute: a checkpointable layer's checkpoint function (transformers'
``_gradient_checkpointing_func``, :data:`~hf_blockdiag_cp.compat.CHECKPOINT_FUNC_ATTR`) is wrapped by a
:class:`_Carry` that snapshots the forward's :class:`Held` state when the layer runs and hands the checkpoint a
function that makes that snapshot the state's ``replaying`` one while the layer (or its recompute) runs. The
snapshot lives as long as the checkpoint keeps its function: until that layer's backward.

A checkpoint that does not go through that function (torch's ``checkpoint_wrapper`` around a layer, a user's own
``torch.utils.checkpoint``) carries nothing. For those, every checkpointable layer's pre-hook files the forward's
state under the layer's input hidden states, weakly (the checkpoint keeps that tensor until the layer's backward),
and a served mixer, indexer or attention layer reading held state in such a recompute while more than one forward
has live entries is refused naming the cause (:func:`check_recompute`), on every rank alike.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..compat import CHECKPOINT_FUNC_ATTR, in_autograd_backward
from ..errors import UnsupportedModel

__all__ = ["Held", "check_recompute", "install_layer_hooks", "remove_layer_hooks"]


@dataclass(frozen=True, eq=False)
class Held:
    """One packed forward's state that a recompute of its layers reads.

    Attributes:
        probe: the model's :class:`~.prepare.ForwardState`.
        runs: the forward's :class:`~hf_blockdiag_cp.recurrent.runs.LocalRuns` (``None``: one document per row).
        positions: ``[B, T]`` its packed ``position_ids`` when it had no ``cp_context`` (else ``None``).
        context: its ``cp_context`` (CP > 1) or ``None``.
    """

    probe: Any
    runs: Any
    positions: torch.Tensor | None = None
    context: Any = None


class _Filed:
    """Objects -> :class:`Held`, by identity and weakly: an entry lives as long as its object (as long as a pending
    checkpoint keeps it). Not a ``WeakKeyDictionary``: that compares keys with ``==``, elementwise for tensors."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[weakref.ref, Held]] = {}

    def put(self, obj: Any, held: Held) -> None:
        key, items = id(obj), self._items
        items[key] = (weakref.ref(obj, lambda _, k=key: items.pop(k, None)), held)

    def alive(self, probe: Any) -> int:
        """How many distinct forwards (by what they hold: fragments, positions, context) of ``probe``'s model have
        state filed under a live object (a filed state keeps its parts alive, so their ids stay theirs)."""
        return len({(id(held.runs), id(held.positions), id(held.context)) for ref, held in list(self._items.values())
                    if held.probe is probe and ref() is not None})


#: The forward state filed under each object a checkpointable layer received; this module's one cache.
_FILED = _Filed()
_HOOK_ATTR = "_blockdiag_cp_layer_hook"
#: Where :func:`~hf_blockdiag_cp.model.prepare.prepare_model` puts the model's probe on every submodule (read from
#: the layer itself, so that a deep copy of the model reads its own).
PROBE_ATTR = "_blockdiag_cp_probe"


def _replay(held: Held, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``function`` (a checkpointed layer forward, first run or recompute) with ``held`` as its model's state."""
    probe = held.probe
    outer, probe.replaying = probe.replaying, held
    try:
        return function(*args, **kwargs)
    finally:
        probe.replaying = outer


class _Carry:
    """A layer's checkpoint function that hands the checkpoint its forward's :class:`Held` state with the layer's
    forward (so the recompute runs with it). Its own owner: one per layer, replaced when transformers sets a new
    checkpoint function."""

    def __init__(self, inner: Callable[..., Any], probe: Any) -> None:
        self.inner, self.probe = inner, probe

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.inner(functools.partial(_replay, self.probe.current(), function), *args, **kwargs)


def _layer_pre_hook(layer: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    probe = layer.__dict__.get(PROBE_ATTR)
    if probe is None or in_autograd_backward() or not probe.starts:
        return
    inner = layer.__dict__.get(CHECKPOINT_FUNC_ATTR)
    if inner is not None and not isinstance(inner, _Carry):
        layer.__dict__[CHECKPOINT_FUNC_ATTR] = _Carry(inner, probe)
    # Filed whatever checkpoints the layer: torch's checkpoint wrapper runs this hook inside the checkpoint (under
    # no_grad when reentrant) and sets no transformers flag. Only a recompute reads the count.
    hidden = args[0] if args else kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor):
        _FILED.put(hidden, probe.current())


def check_recompute(probe: Any, what: str) -> None:
    """Refuse reading ``probe``'s latest forward state (``what`` reads it) in a recompute that carries no state of
    its own while more than one packed forward waits."""
    waiting = _FILED.alive(probe) if in_autograd_backward() and probe.replaying is None else 0
    if waiting > 1:
        raise UnsupportedModel(
            f"blockdiag_cp: {what} is recomputed (activation checkpointing) while {waiting} packed "
            "forwards wait for this backward, by a checkpoint that does not go through transformers' "
            "gradient_checkpointing_enable (which carries each forward's document fragments to its recompute); the "
            "recompute cannot tell whose fragments are its own, and using the latest forward's would be silently "
            "wrong. Use model.gradient_checkpointing_enable(), put the batches in one forward (rows of one packed "
            "batch), or run each forward's backward before the next forward")


def install_layer_hooks(model: torch.nn.Module) -> None:
    """Give every checkpointable layer of ``model`` the pre-hook (idempotent)."""
    for module in model.modules():
        if hasattr(type(module), "gradient_checkpointing") and _HOOK_ATTR not in module.__dict__:
            module.__dict__[_HOOK_ATTR] = module.register_forward_pre_hook(_layer_pre_hook, with_kwargs=True)


def remove_layer_hooks(model: torch.nn.Module) -> None:
    """Remove what :func:`install_layer_hooks` installed (and unwrap the checkpoint functions)."""
    for module in model.modules():
        handle = module.__dict__.pop(_HOOK_ATTR, None)
        if handle is not None:
            handle.remove()
        carry = module.__dict__.get(CHECKPOINT_FUNC_ATTR)
        if isinstance(carry, _Carry):
            module.__dict__[CHECKPOINT_FUNC_ATTR] = carry.inner
