"""Which packed forwards are waiting for a backward: an activation-checkpoint recompute must read its own forward's
fragments, or be refused.

The model's pre-hook plans the fragments of the forward's rows (:func:`~hf_blockdiag_cp.recurrent.runs.local_runs`)
and the probe holds them while the forward runs and after it. transformers 5.25 checkpoints a layer's ``forward``
(not its ``__call__``), so a recompute during backward re-runs the layer's children without the layer's own hooks and
without anything that says which forward it belongs to; the probe then holds the LATEST forward's fragments. That is
right when one packed forward waits for the backward and silently wrong when two do (DPO's chosen / rejected, summed
micro-batches): the first forward's recompute would run on the second forward's document boundaries.

So every checkpointable layer (a module with a ``gradient_checkpointing`` flag) gets a pre-hook that, in a forward,
files the forward's :class:`Held` state under the layer's input hidden states, weakly: the checkpoint keeps that
tensor until the layer's backward, so a forward whose layers still wait for a recompute has live entries. A served
mixer or indexer called in a recompute while more than one forward has live entries is refused naming the cause
(:func:`check_recompute`), on every rank alike, never run with another forward's fragments.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..compat import in_autograd_backward
from ..errors import UnsupportedModel

__all__ = ["Held", "check_recompute", "install_layer_hooks", "remove_layer_hooks"]


@dataclass(frozen=True, eq=False)
class Held:
    """A packed forward whose checkpointed layers wait for a recompute: its model's probe and its fragments."""

    probe: Any
    runs: Any


class _Filed:
    """Objects -> :class:`Held`, by identity and weakly: an entry lives as long as its object (as long as a pending
    checkpoint keeps it). Not a ``WeakKeyDictionary``: that compares keys with ``==``, elementwise for tensors."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[weakref.ref, Held]] = {}

    def put(self, obj: Any, held: Held) -> None:
        key, items = id(obj), self._items
        items[key] = (weakref.ref(obj, lambda _, k=key: items.pop(k, None)), held)

    def get(self, obj: Any) -> Held | None:
        entry = self._items.get(id(obj))
        return entry[1] if entry is not None and entry[0]() is obj else None

    def alive(self, probe: Any) -> int:
        """How many distinct forwards of ``probe``'s model have state filed under a live object."""
        return len({id(held.runs) for ref, held in list(self._items.values())
                    if held.probe is probe and ref() is not None})


#: The forward state filed under each object a checkpointable layer received; this module's one cache.
_FILED = _Filed()
_HOOK_ATTR = "_blockdiag_cp_layer_hook"
#: Where :func:`~hf_blockdiag_cp.model.prepare.prepare_model` puts the model's probe on every submodule (read from
#: the layer itself, so that a deep copy of the model reads its own).
PROBE_ATTR = "_blockdiag_cp_probe"


def _layer_pre_hook(layer: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    probe = layer.__dict__.get(PROBE_ATTR)
    if probe is None or in_autograd_backward() or not probe.starts or probe.runs is None:
        return
    if not (getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled()):
        return  # no recompute will run this layer again
    hidden = args[0] if args else kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor):
        _FILED.put(hidden, Held(probe, probe.runs))


def check_recompute(probe: Any, what: str) -> None:
    """Refuse a recompute (``what`` reads the probe's forward state) while more than one packed forward waits."""
    waiting = _FILED.alive(probe) if in_autograd_backward() else 0
    if waiting > 1:
        raise UnsupportedModel(
            f"blockdiag_cp: {what} is recomputed (activation checkpointing) while {waiting} packed "
            "forwards wait for this backward; the recompute cannot tell whose document fragments are its own, and "
            "using the latest forward's would be silently wrong. Put the batches in one forward (rows of one packed "
            "batch, e.g. chosen and rejected side by side), run each forward's backward before the next forward, "
            "or turn gradient checkpointing off for this pattern")


def install_layer_hooks(model: torch.nn.Module) -> None:
    """Give every checkpointable layer of ``model`` the pre-hook (idempotent)."""
    for module in model.modules():
        if hasattr(type(module), "gradient_checkpointing") and _HOOK_ATTR not in module.__dict__:
            module.__dict__[_HOOK_ATTR] = module.register_forward_pre_hook(_layer_pre_hook, with_kwargs=True)


def remove_layer_hooks(model: torch.nn.Module) -> None:
    """Remove what :func:`install_layer_hooks` installed."""
    for module in model.modules():
        handle = module.__dict__.pop(_HOOK_ATTR, None)
        if handle is not None:
            handle.remove()
