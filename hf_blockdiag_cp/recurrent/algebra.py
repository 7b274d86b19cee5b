"""State algebras: what a fragment of a document hands to the next one, and how those hand-offs compose.

Every served recurrence is linear in its state. So a fragment (a piece of a document on one rank, see
:mod:`hf_blockdiag_cp.planning.fragments`) run from a zero state is summarised by a :class:`Summary`: its *end*
state from zero and its *transition* (what it does to a state entering it). The state entering a continuing fragment
is the fold of the earlier fragments' summaries in document order, from the document's start (the identity: no
state)::

    S_1 = end_1,    S_k = T_k(S_{k-1}) + end_k

Families (notation: ``H`` heads, ``Dk``/``Dv`` key/value widths, ``P`` head dim, ``N`` state size):

- :class:`DecayAlgebra`: ``T(S) = a * S`` with a per-head / per-channel decay ``a`` broadcast over the state (SSD
  ``a [H]`` on ``[H, P, N]``; Mamba1 ``exp(A sum delta) [D, N]``; RG-LRU ``prod a_t [W]``; lightning
  ``exp(-rate L) [H]`` on ``[H, D, D]``);
- :class:`MatrixAlgebra`: ``T(S) = M S`` with ``M [H, Dk, Dk]`` (gated delta rule, KDA);
- :class:`MlstmAlgebra`: the log-stabilised matrix memory ``(C, n, m)`` of xLSTM with total log forget gate ``F``;
- :class:`WindowAlgebra`: the state is the last ``w`` inputs ``[w, C]`` (causal convolutions, windowed modules);
  composition concatenates and keeps the last ``w`` (a fragment of ``n < w`` tokens contributes ``n``).

A summary travels as one flat fp32 vector of :attr:`StateAlgebra.width` floats: the end parts, then the transition
parts (zeros for a fragment at its document's start, whose transition is never used).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["DecayAlgebra", "MatrixAlgebra", "MlstmAlgebra", "StateAlgebra", "Summary", "WindowAlgebra"]

State = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Summary:
    """One fragment's hand-off: ``end`` (its state from zero, the algebra's parts) and ``transition`` (``None`` at a
    document's start)."""

    end: State
    transition: State | None = None


class StateAlgebra(ABC):
    """A family's summary layout and composition. ``end_shapes`` / ``transition_shapes``: each part's shape."""

    def __init__(self, end_shapes: Sequence[tuple[int, ...]], transition_shapes: Sequence[tuple[int, ...]]) -> None:
        self.end_shapes = tuple(tuple(s) for s in end_shapes)
        self.transition_shapes = tuple(tuple(s) for s in transition_shapes)
        self._sizes = [math.prod(s) for s in (*self.end_shapes, *self.transition_shapes)]

    @property
    def width(self) -> int:
        """``W``: floats in one packed summary."""
        return sum(self._sizes)

    def pack(self, summary: Summary) -> torch.Tensor:
        """``[W]`` fp32: the end parts then the transition parts (zeros without a transition)."""
        parts = [p.float().reshape(-1) for p in summary.end]
        if summary.transition is None:
            parts.append(parts[0].new_zeros(sum(self._sizes[len(self.end_shapes):])))
        else:
            parts += [p.float().reshape(-1) for p in summary.transition]
        return torch.cat(parts)

    def unpack(self, flat: torch.Tensor) -> Summary:
        """The inverse of :meth:`pack` (views of ``flat [W]``)."""
        pieces = flat.split(self._sizes)
        shapes = (*self.end_shapes, *self.transition_shapes)
        parts = tuple(p.view(s) for p, s in zip(pieces, shapes))
        n = len(self.end_shapes)
        return Summary(parts[:n], parts[n:])

    def fold(self, flats: Sequence[torch.Tensor], lengths: Sequence[int]) -> State:
        """The state entering a fragment from the packed summaries of the earlier fragments of its document, in
        document order (``lengths``: their token counts), in fp32."""
        state: State | None = None
        for flat, length in zip(flats, lengths):
            summary = self.unpack(flat)
            state = self.start(summary, length) if state is None else self.compose(state, summary, length)
        assert state is not None, "a continuing fragment has at least one earlier fragment"
        return state

    def start(self, summary: Summary, length: int) -> State:
        """The state after a document's first fragment: its end state from zero (the identity composed)."""
        return summary.end

    @abstractmethod
    def compose(self, state: State, summary: Summary, length: int) -> State:
        """The state after a fragment entered with ``state``: ``T(state) + end``."""


class DecayAlgebra(StateAlgebra):
    """``S <- a * S + end``: ``state_shapes`` one part, ``decay_shape`` broadcast over its trailing axes."""

    def __init__(self, state_shape: tuple[int, ...], decay_shape: tuple[int, ...]) -> None:
        super().__init__([state_shape], [decay_shape])
        self._broadcast = decay_shape + (1,) * (len(state_shape) - len(decay_shape))

    def compose(self, state: State, summary: Summary, length: int) -> State:
        return (summary.transition[0].reshape(self._broadcast) * state[0] + summary.end[0],)


class MatrixAlgebra(StateAlgebra):
    """``S <- M S + end`` with ``S [1, H, Dk, Dv]`` and ``M [1, H, Dk, Dk]``."""

    def __init__(self, heads: int, dk: int, dv: int) -> None:
        super().__init__([(1, heads, dk, dv)], [(1, heads, dk, dk)])

    def compose(self, state: State, summary: Summary, length: int) -> State:
        return (summary.transition[0] @ state[0] + summary.end[0],)


class MlstmAlgebra(StateAlgebra):
    """xLSTM's ``(C [1, H, Dqk, Dv], n [1, H, Dqk], m [1, H, 1])`` with total log forget gate ``F [1, H, 1]``: the
    state stands for ``(C, n) exp(m)``, so ``m' = max(F + m, m_0)``, ``C' = exp(F + m - m') C + exp(m_0 - m') C_0``
    (``n`` likewise)."""

    def __init__(self, heads: int, dqk: int, dv: int) -> None:
        super().__init__([(1, heads, dqk, dv), (1, heads, dqk), (1, heads, 1)], [(1, heads, 1)])

    def compose(self, state: State, summary: Summary, length: int) -> State:
        c, n, m = state
        c0, n0, m0 = summary.end
        total = summary.transition[0]
        m_new = torch.maximum(total + m, m0)
        old, new = torch.exp(total + m - m_new), torch.exp(m0 - m_new)
        return old[..., None] * c + new[..., None] * c0, old * n + new * n0, m_new


class WindowAlgebra(StateAlgebra):
    """The last ``window`` inputs ``[window, C]`` (oldest first, zeros before the document's start)."""

    def __init__(self, window: int, channels: int) -> None:
        super().__init__([(window, channels)], [])
        self.window = window

    def compose(self, state: State, summary: Summary, length: int) -> State:
        recent = summary.end[0][self.window - min(length, self.window):]
        return (torch.cat([state[0], recent])[-self.window:],)

    @staticmethod
    def tail(x: torch.Tensor, window: int) -> torch.Tensor:
        """The last ``window`` rows of ``x [T, C]`` as ``[window, C]`` fp32, zeros first when ``T < window``."""
        rows = x[max(0, x.shape[0] - window):].float()
        return torch.nn.functional.pad(rows, (0, 0, window - rows.shape[0], 0))
