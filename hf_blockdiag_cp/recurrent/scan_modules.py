"""Scan modules (:data:`~.functions.SCAN_MODULES`, xLSTM's mLSTM backend) once per fragment.

The mLSTM keeps a matrix state ``C [H, Dqk, Dv]``, a normalizer ``n [H, Dqk]`` and a stabilizer ``m [H, 1]``; the
state it stands for is ``(C, n) * exp(m)``, which evolves linearly: ``C~_t = exp(f_t) C~_{t-1} + exp(i_t) k_t v_t^T``
with ``f_t = logsigmoid(forget gate)``. So a fragment's end state from the document's start composes from the
earlier fragments' end states from zero and their total log forget gate ``F``:

    m' = max(F + m, m_0),  C' = exp(F + m - m') C + exp(m_0 - m') C_0,  n' likewise

in fp32. Every fragment runs the module's own ``forward``: at its document's start (or padding) from the module's
zero state; under CP a fragment that a later fragment of its document follows sends ``(C_0, n_0, m_0, F)``
(``W = H Dqk Dv + H Dqk + 2 H`` floats, one fixed-shape all-gather per layer and direction, as in
:mod:`.state_passing`), and a continuing fragment runs from the composed state. ``m`` is only a stabilizer: the
module's output depends on it through its ``eps`` alone (``h = q C~ / (max(|q n~|, 1) + eps exp(m))``), as it does on
the module's own chunking.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import UnsupportedModel
from .functions import ScanModule
from .runs import LocalRuns
from .summaries import run_with_summaries

__all__ = ["run_scan_module"]


def _call(spec: ScanModule, original: Callable, named: dict[str, Any], row: int, start: int, length: int,
          states: tuple[torch.Tensor, ...] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The module on local rows ``[start, start + length)`` of batch row ``row``: ``(h, last states)``."""
    sub = dict(named)
    for name, dim in spec.time_args.items():
        value = sub.get(name)
        if isinstance(value, torch.Tensor):
            sub[name] = value[row:row + 1].narrow(dim, start, length)
    for name, value in zip(spec.state_in, states or (None,) * len(spec.state_in)):
        sub[name] = value
    sub[spec.state_flag] = True
    h, last = original(**sub)
    return h, tuple(last)


def _summary(spec: ScanModule, named: dict[str, Any], f: Any, last: tuple[torch.Tensor, ...],
             continues: bool) -> torch.Tensor:
    """``(C_0, n_0, m_0, F)`` of a fragment, flattened fp32 (``F`` zeros at a document's start: unused)."""
    fgate = named["fgate"][f.row:f.row + 1].narrow(2, f.start, f.length).float()  # [1, H, T]
    total = torch.nn.functional.logsigmoid(fgate).sum(-1) if continues else fgate.new_zeros(fgate.shape[:2])
    return torch.cat([*(s.float().flatten() for s in last), total.flatten()])


def _compose(rows: list[torch.Tensor], heads: int, dqk: int, dv: int) -> tuple[torch.Tensor, ...]:
    """The state ``(C [1, H, Dqk, Dv], n [1, H, Dqk], m [1, H, 1])`` entering a fragment (see the module docstring)."""
    sizes = [heads * dqk * dv, heads * dqk, heads, heads]
    state = None
    for summary in rows:
        c0, n0, m0, total = summary.split(sizes)
        c0, n0 = c0.view(1, heads, dqk, dv), n0.view(1, heads, dqk)
        m0, total = m0.view(1, heads, 1), total.view(1, heads, 1)
        if state is None:  # the document's first fragment: its state from zero is the state
            state = (c0, n0, m0)
            continue
        c, n, m = state
        m_new = torch.maximum(total + m, m0)
        old, new = torch.exp(total + m - m_new), torch.exp(m0 - m_new)
        state = (old[..., None] * c + new[..., None] * c0, old * n + new * n0, m_new)
    return state


def run_scan_module(spec: ScanModule, original: Callable, runs: LocalRuns, named: dict[str, Any],
                    returns_states: bool) -> Any:
    """One call of a scan module on the forward's packed rows: ``h [B, H, L, Dv]``, with the last states when the
    call returns them (``returns_states``; at CP = 1 each row's last fragment's, as a prefill's cache keeps them)."""
    if any(named.get(name) is not None for name in spec.state_in):
        raise UnsupportedModel(f"{spec.name} got an initial state (a cache) with packed rows; blockdiag_cp trains "
                               "packed rows without a cache (pass use_cache=False)")
    cp = runs.cp_size > 1
    if cp and not returns_states:
        raise UnsupportedModel(f"{spec.name} does not return its last states here (return_last_states=False, e.g. "
                               "xLSTM's train_with_padding mode): the state passing between CP ranks needs them")
    key, value = named["key"], named["value"]
    heads, dqk, dv = key.shape[1], key.shape[3], value.shape[3]
    out, ends = run_with_summaries(
        runs, heads * dqk * dv + heads * dqk + 2 * heads, key.device, spec.out_dim,
        lambda f, state: _call(spec, original, named, f.row, f.start, f.length, state),
        lambda f, last, continues: _summary(spec, named, f, last, continues),
        lambda rows: _compose(rows, heads, dqk, dv))
    if not returns_states:
        return out
    if cp:  # a shard's last fragment is not the row's end; a cache under CP is refused above
        return out, None
    return out, tuple(torch.cat(parts, 0) for parts in zip(*(ends[r] for r in range(runs.batch_size))))
