"""Runners of served whole modules (:mod:`.driver`'s protocol): a module once per fragment.

- :class:`WindowRunner` (:class:`~.specs.WindowedModule`): outputs read a window of ``w`` earlier inputs; a
  continuing fragment runs on the document's last ``min(w, earlier tokens)`` inputs (the summaries, a
  :class:`~.algebra.WindowAlgebra`) followed by its own and drops the outputs of the former.
- :class:`StatefulRunner` (:class:`~.specs.StatefulModule`, MiniMax's lightning attention): the recurrence runs inside
  the module's forward; a fragment starts from zero without a cache, a continuing one gets its entering state from
  a stand-in cache (:class:`HandedState`); transition ``exp(-rate L)`` per head (a :class:`~.algebra.DecayAlgebra`).
- :class:`ScanModuleRunner` (:class:`~.specs.ScanModule`): a module that is one scan taking its initial states as
  arguments and returning its last states; its algebra and transition are the spec's (xLSTM's mLSTM:
  :class:`~.algebra.MlstmAlgebra`, transition the total log forget gate).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .algebra import DecayAlgebra, State, WindowAlgebra
from .specs import ScanModule, StatefulModule, WindowedModule, time_axis

__all__ = ["HandedState", "ScanModuleRunner", "StatefulRunner", "WindowRunner"]


def _rows(outputs: Sequence[tuple], frags: Sequence[Any], batch: int, dim: int) -> tuple:
    """Per-fragment output tuples laid back into rows: a tuple of ``[B, T, ...]`` (time axis ``dim``)."""
    rows = []
    for b in range(batch):
        pieces = [o for o, f in zip(outputs, frags) if f.row == b]
        rows.append(tuple(torch.cat(ps, time_axis(ps[0], dim)) if len(ps) > 1 else ps[0] for ps in zip(*pieces)))
    return tuple(torch.cat(ps, 0) if len(ps) > 1 else ps[0] for ps in zip(*rows))


class _ModuleRunner:
    """What the module runners share: no corrections, fragments in local order, rows of ``batch``."""

    corrects = False
    augments = False
    batches = False
    window = False
    final = False

    def __init__(self, frags: Sequence[Any], batch: int) -> None:
        self.frags, self.batch = frags, batch

    def transitions(self, frags: Sequence[Any]) -> list[State]:
        raise TypeError(f"{type(self).__name__} has no transitions (its summary is its inputs)")

    def tails(self, frags: Sequence[Any]) -> list[State]:
        raise TypeError(f"{type(self).__name__} has no input tails (only window runners do)")

    def partial(self, frags: Sequence[Any]) -> tuple:
        raise TypeError(f"{type(self).__name__} does not correct")

    correct = partial


class WindowRunner(_ModuleRunner):
    """A :class:`~.specs.WindowedModule`: ``named[spec.sequence]`` is ``[B, T, C]`` (or channels first)."""

    window = True

    def __init__(self, spec: WindowedModule, original: Callable, named: dict[str, Any], width: int,
                 frags: Sequence[Any]) -> None:
        mask = named.get(spec.mask) if spec.mask else None
        x = named[spec.sequence]
        if mask is not None:  # the module zeroes padded inputs itself; the sent windows must be zeroed the same way
            x = x * mask[..., None].to(x.dtype)
            named = {**named, spec.sequence: x, spec.mask: None}
        super().__init__(frags, x.shape[0])
        self.spec, self.original, self.named = spec, original, named
        self.seq = x if spec.time_dim == 1 else x.transpose(1, 2)  # [B, T, C]
        self.algebra = WindowAlgebra(width, self.seq.shape[-1])

    def _call(self, inputs: torch.Tensor, drop: int) -> tuple:
        """The module on ``inputs [1, T', C]``: its outputs at steps ``[drop, T')``."""
        spec, steps = self.spec, inputs.shape[1]
        out = self.original(**{**self.named, spec.sequence: inputs if spec.time_dim == 1 else inputs.transpose(1, 2)})
        parts = out if isinstance(out, tuple) else (out,)
        return tuple(p.narrow(time_axis(p, spec.time_dim), drop, steps - drop) for p in parts)

    def run(self, frags: Sequence[Any], states: Sequence[State] | None, want_end: bool) -> tuple[list, None]:
        outs = []
        for j, f in enumerate(frags):
            own = self.seq[f.row:f.row + 1, f.start:f.start + f.length]
            if states is None:
                outs.append(self._call(own, 0))
                continue
            earlier = min(self.algebra.window, f.global_start - f.doc_start)
            history = states[j][0][self.algebra.window - earlier:].to(own.dtype)[None]  # [1, earlier, C]
            outs.append(self._call(torch.cat([history, own], 1), earlier))
        return outs, None

    def tails(self, frags: Sequence[Any]) -> list[State]:
        return [(WindowAlgebra.tail(self.seq[f.row, f.start:f.start + f.length], self.algebra.window),) for f in frags]

    def assemble(self, outputs: list, ends: list[State] | None) -> Any:
        out = _rows(outputs, self.frags, self.batch, self.spec.time_dim)
        return out if len(out) > 1 else out[0]


class HandedState:
    """A stand-in cache handing a :class:`~.specs.StatefulModule` the state entering its fragment (MiniMax's cache
    protocol: ``get_linear_cache(layer_idx)`` / ``set_linear_cache(layer_idx, state)``); the state it leaves is the
    forward's second output, so nothing is kept."""

    def __init__(self, state: torch.Tensor) -> None:
        self.state = state

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor:
        return self.state

    def set_linear_cache(self, layer_idx: int, state: torch.Tensor) -> None:
        pass


def _time_slice(value: Any, f: Any) -> Any:
    """Rows ``[f.start, f.start + f.length)`` of batch row ``f.row`` of a ``[B, T, ...]`` tensor or tuple of them."""
    if isinstance(value, torch.Tensor):
        return value[f.row:f.row + 1, f.start:f.start + f.length]
    if isinstance(value, (tuple, list)):
        return type(value)(_time_slice(v, f) for v in value)
    return value


def stateful_decay(spec: StatefulModule, module: torch.nn.Module, length: int) -> torch.Tensor:
    """``[H]`` fp32: how much a :class:`~.specs.StatefulModule`'s state decays over ``length`` tokens."""
    heads = int(getattr(module, spec.heads_attr))
    return torch.exp(-getattr(module, spec.rate_attr).float().reshape(heads) * length)


class StatefulRunner(_ModuleRunner):
    """A :class:`~.specs.StatefulModule` (``named`` without its cache): ``(out [B, T, C], end [1, H, D, D])``."""

    def __init__(self, spec: StatefulModule, module: torch.nn.Module, original: Callable, named: dict[str, Any],
                 frags: Sequence[Any]) -> None:
        super().__init__(frags, named[spec.sequence].shape[0])
        self.spec, self.module, self.original, self.named = spec, module, original, named
        heads, dim = int(getattr(module, spec.heads_attr)), int(getattr(module, spec.dim_attr))
        self.algebra = DecayAlgebra((1, heads, dim, dim), (1, heads))

    def run(self, frags: Sequence[Any], states: Sequence[State] | None, want_end: bool) -> tuple[list, list]:
        spec, outs, ends = self.spec, [], []
        for j, f in enumerate(frags):
            sub = {**self.named, **{n: _time_slice(self.named.get(n), f) for n in (spec.sequence, *spec.time_args)
                                    if n in self.named}}
            sub[spec.cache] = None if states is None else HandedState(states[j][0])
            out, end = self.original(**sub)[:2]
            outs.append(out)
            ends.append((end,))
        return outs, ends

    def transitions(self, frags: Sequence[Any]) -> list[State]:
        return [(stateful_decay(self.spec, self.module, f.length),) for f in frags]

    def assemble(self, outputs: list, ends: list[State] | None) -> Any:
        out = _rows([(o,) for o in outputs], self.frags, self.batch, 1)[0]
        if ends is None:
            return out, None
        last = [max(i for i, f in enumerate(self.frags) if f.row == b) for b in range(self.batch)]
        return out, torch.cat([ends[i][0] for i in last], 0)


class ScanModuleRunner(_ModuleRunner):
    """A :class:`~.specs.ScanModule`: ``h`` (time axis ``spec.out_dim``) and, where asked, the last states."""

    def __init__(self, spec: ScanModule, original: Callable, named: dict[str, Any], returns_states: bool,
                 frags: Sequence[Any]) -> None:
        lead = named[next(iter(spec.time_args))]
        super().__init__(frags, lead.shape[0])
        self.spec, self.original, self.named, self.returns_states = spec, original, named, returns_states
        self.algebra = spec.algebra(named)

    def run(self, frags: Sequence[Any], states: Sequence[State] | None, want_end: bool) -> tuple[list, list]:
        spec, outs, ends = self.spec, [], []
        for j, f in enumerate(frags):
            sub = dict(self.named)
            for name, dim in spec.time_args.items():
                value = sub.get(name)
                if isinstance(value, torch.Tensor):
                    sub[name] = value[f.row:f.row + 1].narrow(dim, f.start, f.length)
            entering = states[j] if states is not None else (None,) * len(spec.state_in)
            for name, value in zip(spec.state_in, entering):
                sub[name] = value
            sub[spec.state_flag] = True
            h, last = self.original(**sub)
            outs.append(h)
            ends.append(tuple(last))
        return outs, ends

    def transitions(self, frags: Sequence[Any]) -> list[State]:
        return [self.spec.transition(self.named, f) for f in frags]

    def assemble(self, outputs: list, ends: list[State] | None) -> Any:
        out = _rows([(o,) for o in outputs], self.frags, self.batch, self.spec.out_dim)[0]
        if not self.returns_states:
            return out
        if ends is None:  # under CP a shard's last fragment is not the row's end (a cache under CP is refused)
            return out, None
        last = [max(i for i, f in enumerate(self.frags) if f.row == b) for b in range(self.batch)]
        return out, tuple(torch.cat(parts, 0) for parts in zip(*(ends[i] for i in last)))
