"""The runner of a served scan call (:class:`~.specs.ScanFunction`): the model's own function once per fragment, or
one of the package's ops over all the fragments at once (:mod:`.ops`, chosen by :mod:`.backend`).

Legend: ``B`` rows, ``T`` local tokens per row, ``T* = B T``; an op reads the call's time tensors as one packed row
``[1, T*, ...]`` channels last (:data:`TIME`) with the fragments as its ``cu_seqlens``. Each fragment's output is
kept in the model function's own layout and dtype; :meth:`ScanRunner.assemble` lays them back into rows.

Entering states (from :mod:`.algebra`): a convolution gets its window of earlier inputs prepended (the model's
function) or as the op's initial state; Mamba1's function takes no state, so its output from a state is its output
from zero plus what the state adds, ``C_t (exp(A cumsum delta) * S)`` gated by ``silu(z)`` (:func:`_selective_read`);
SSD corrects the same way (:func:`_ssd_read`), so an SSD / Mamba1 fragment runs once even when it continues and sends.
Transitions come from the ops' helpers on the call's own arguments (one way for both backends). Delta rule / KDA on
an op *correct*: a continuing fragment runs once, augmented (values with ``Dk`` zero columns, initial state
``[0 | I]``), which yields its transition ``M`` and ``Q_t = M_t^T q_t``; after the gather ``o_t(S) = o_t(0) + S^T Q_t``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import ops
from .algebra import DecayAlgebra, MatrixAlgebra, State, StateAlgebra, WindowAlgebra
from .kinds import MixerKind
from .ops.adapters import LIBRARY_OPS, library_unavailable_reason
from .specs import ScanFunction, time_axis

__all__ = ["OP_OF_KIND", "TIME", "ScanRunner", "known_arguments", "scan_algebra"]

K = MixerKind
#: The op behind each kind (a key of :data:`~.ops.TORCH_OPS` and :data:`~.ops.adapters.LIBRARY_OPS`).
OP_OF_KIND: dict[MixerKind, str] = {K.CONV: "causal_conv1d", K.SSD: "ssd_chunk_scan", K.DELTA: "chunk_gated_delta_rule",
                                    K.KDA: "chunk_kda", K.SELECTIVE: "selective_scan"}
#: The call's time tensors per kind, in the op's order, and whether the function has them channels first.
TIME: dict[MixerKind, tuple[tuple[str, bool], ...]] = {
    K.CONV: (("hidden_states", True),),
    K.SELECTIVE: (("hidden_states", True), ("dt", True), ("B", True), ("C", True), ("z", True)),
    K.SSD: (("hidden_states", False), ("dt", False), ("B", False), ("C", False)),
    K.DELTA: tuple((n, False) for n in ("query", "key", "value", "g", "beta")),
    K.KDA: tuple((n, False) for n in ("query", "key", "value", "g", "beta")),
}
#: Arguments the op path maps beyond the function's leading parameters (the rest must be absent / None).
_EXTRA_KNOWN: dict[MixerKind, frozenset[str]] = {K.SSD: frozenset({"z"}),
                                                 K.SELECTIVE: frozenset({"use_mambapy", "use_associative_scan"})}
#: Chunk sizes of the ops on CPU (``benchmarks/bench_recurrent_ops.py``); results do not depend on them.
_CHUNK: dict[MixerKind, int] = {K.SSD: 256, K.DELTA: 64, K.KDA: 64, K.SELECTIVE: 64}


def known_arguments(spec: ScanFunction) -> frozenset[str]:
    """Every argument of ``spec``'s calls that the op path reads."""
    return frozenset(spec.params) | _EXTRA_KNOWN.get(spec.kind, frozenset())


def scan_algebra(kind: MixerKind, named: dict[str, Any]) -> StateAlgebra:
    """The state algebra of one scan call, from its arguments' shapes."""
    if kind is K.CONV:
        weight = named["weight"]
        return WindowAlgebra(weight.shape[-1] - 1, weight.shape[0])
    if kind is K.SSD:
        x, b = named["hidden_states"], named["B"]
        return DecayAlgebra((1, x.shape[2], x.shape[3], b.shape[3]), (1, x.shape[2]))
    if kind is K.SELECTIVE:
        return DecayAlgebra((1, *named["A"].shape), (1, *named["A"].shape))
    if kind is K.DIAG:
        width = named["hidden_states"].shape[-1]
        return DecayAlgebra((1, width), (1, width))
    key, value = named["key"], named["value"]
    return MatrixAlgebra(value.shape[2], key.shape[3], value.shape[3])


def _limit(named: dict[str, Any]) -> tuple[float, float]:
    limit = named.get("dt_limit")
    return (0.0, math.inf) if limit is None else tuple(limit)


class ScanRunner:
    """Fragments of one scan call (see the module docstring).

    Args:
        spec: the call's description; original: the model's own function; named: the call's arguments by name
        (packing keywords removed); backend: ``"model"``, ``"torch"``, ``"fla"`` or ``"mamba_ssm"``;
        final: the call asks for its final state (CP = 1 only); frags: the forward's local fragments in order.
    """

    def __init__(self, spec: ScanFunction, original: Callable, named: dict[str, Any], backend: str,
                 final: bool, frags: Sequence[Any]) -> None:
        self.spec, self.original, self.named, self.backend, self.final = spec, original, named, backend, final
        self._frags = frags  # every local fragment, in local order (what assemble reads)
        self.kind = spec.kind
        self.algebra = scan_algebra(self.kind, named)
        self.window = self.kind is K.CONV
        # outputs linear in the entering state with a cheap read: continuing fragments run once, before the gather
        self.corrects = self.kind in (K.SSD, K.SELECTIVE) or (backend != "model" and self.kind in (K.DELTA, K.KDA))
        self.batches = backend != "model"  # the ops run every fragment of a call at once; the model's function, one
        self.augments = self.corrects and self.kind in (K.DELTA, K.KDA)  # reads from a pass with Dk more value columns
        self._row: dict[str, torch.Tensor] | None = None

    # ------------------------------------------------------------------ layout
    @property
    def batch(self) -> tuple[int, int]:
        lead = self.named[next(iter(self.spec.time_args))]
        return lead.shape[0], lead.shape[time_axis(lead, self.spec.time_args[next(iter(self.spec.time_args))])]

    def packed(self) -> dict[str, torch.Tensor]:
        """The time tensors as one packed row ``[1, T*, ...]`` channels last (views; built once per call)."""
        if self._row is None:
            self._row = {}
            for name, channels_first in TIME.get(self.kind, ()):
                t = self.named.get(name)
                if t is None:
                    continue
                t = t.transpose(1, 2) if channels_first else t
                self._row[name] = t.reshape(1, t.shape[0] * t.shape[1], *t.shape[2:]) if t.shape[0] > 1 else t
        return self._row

    def _select(self, frags: Sequence[Any]) -> tuple[dict[str, torch.Tensor], list[int], torch.Tensor]:
        """The packed time tensors of ``frags`` (in order), their lengths and ``cu_seqlens``."""
        row, length = self.packed(), self.batch[1]
        first = next(iter(row.values()))
        lens = [f.length for f in frags]
        starts = [f.row * length + f.start for f in frags]
        if all(a + n == b for a, n, b in zip(starts, lens, starts[1:])):  # one stretch of the row: a view
            row = {k: v.narrow(1, starts[0], sum(lens)) for k, v in row.items()}
        else:
            index = torch.cat([torch.arange(lo, lo + n) for lo, n in zip(starts, lens)]).to(first.device)
            row = {k: v.index_select(1, index) for k, v in row.items()}
        cu = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(first.device)
        return row, lens, cu

    def _to_model(self, piece: torch.Tensor) -> torch.Tensor:
        """One fragment's op output ``[1, n, ...]`` in the layout and dtype of the model's function."""
        kind, named = self.kind, self.named
        if kind in (K.CONV, K.SELECTIVE):
            piece = piece.transpose(1, 2)
        if kind is K.CONV:
            return piece.to(named["hidden_states"].dtype)
        if kind is K.SSD:  # transformers' torch scan computes and returns fp32
            return piece.float()
        if kind is K.SELECTIVE:  # its D skip (an fp32 D) promotes the output
            d = named.get("D")
            return piece if d is None else piece.to(torch.promote_types(piece.dtype, d.dtype))
        return piece.to(named["query"].dtype)

    # ------------------------------------------------------------------ the op
    def _op(self, t: dict[str, torch.Tensor], lens: list[int], cu: torch.Tensor, initial: torch.Tensor | None,
            want_final: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        kind, named = self.kind, self.named
        name = OP_OF_KIND[kind]
        first = t[TIME[kind][0][0]]
        op = ops.TORCH_OPS[name]
        if self.backend in ("fla", "mamba_ssm") and library_unavailable_reason(
                name, first, weight=named.get("weight"), activation=named.get("activation"), initial_state=initial,
                final_state_needs_grad=want_final and torch.is_grad_enabled()) is None:
            op = LIBRARY_OPS[name]
        common = dict(initial_state=initial, output_final_state=want_final, cu_seqlens=cu, seq_lens_host=lens)
        if kind is K.CONV:
            return op(t["hidden_states"], named["weight"], named.get("bias"), named.get("activation"), **common)
        if kind is K.SSD:
            return op(t["hidden_states"], t["dt"], named["A"], t["B"], t["C"], D=named.get("D"),
                      dt_bias=named.get("dt_bias"), dt_softplus=bool(named.get("dt_softplus")),
                      dt_limit=_limit(named), chunk_size=_CHUNK[kind], **common)
        if kind is K.SELECTIVE:
            return op(t["hidden_states"], t["dt"], named["A"], t["B"], t["C"], named.get("D"), t.get("z"),
                      named.get("delta_bias"), bool(named.get("delta_softplus")), chunk_size=_CHUNK[kind], **common)
        return op(t["query"], t["key"], t["value"], t["g"], t["beta"], chunk_size=_CHUNK[kind],
                  use_qk_l2norm_in_kernel=bool(named.get("use_qk_l2norm_in_kernel")), **common)

    def _op_state(self, states: Sequence[State] | None) -> torch.Tensor | None:
        if states is None:
            return None
        if self.kind is K.CONV:  # windows [K - 1, C] -> [N, C, K - 1]
            return torch.stack([s[0] for s in states]).transpose(1, 2)
        return torch.cat([s[0] for s in states])

    # ------------------------------------------------------------------ the model's function
    def _call(self, f: Any, state: torch.Tensor | None, want_end: bool, **replace: torch.Tensor) -> tuple:
        """The model's function on fragment ``f`` (``replace``: inputs given for the fragment's own)."""
        spec, sub = self.spec, dict(self.named)
        for name, dim in spec.time_args.items():
            value = sub.get(name)
            if isinstance(value, torch.Tensor):
                sub[name] = value[f.row:f.row + 1].narrow(time_axis(value, dim), f.start, f.length)
        sub.update(replace)
        if spec.state_in is not None:
            sub[spec.state_in] = state
        if spec.state_flag is not None:
            sub[spec.state_flag] = want_end
        result = self.original(**sub)
        return (result[0], result[1]) if isinstance(result, tuple) else (result, None)

    def _run_model(self, f: Any, state: State | None, want_end: bool) -> tuple[torch.Tensor, State | None]:
        kind = self.kind
        if state is None:
            out, end = self._call(f, None, want_end)
        elif kind is K.CONV:  # the window of earlier inputs first; its outputs dropped
            x = self.named["hidden_states"][f.row:f.row + 1].narrow(-1, f.start, f.length)
            k1 = state[0].shape[0]
            out, end = self._call(f, None, False, hidden_states=torch.cat([state[0].t()[None].to(x.dtype), x], -1))
            out = out[..., k1:]
        elif kind is K.SELECTIVE:
            out, end = self._call(f, None, want_end)
            out = out + _selective_read(self.named, f, state[0])
        else:  # SSD and the diagonal recurrence keep their state in fp32; the delta rules take the values' dtype
            dtype = torch.float32 if kind in (K.SSD, K.DIAG) else self.named["value"].dtype
            out, end = self._call(f, state[0].to(dtype), want_end)
        return out, ((end,) if want_end else None)

    # ------------------------------------------------------------------ the runner protocol
    def run(self, frags: Sequence[Any], states: Sequence[State] | None,
            want_end: bool) -> tuple[list[torch.Tensor], list[State] | None]:
        if not frags:
            return [], [] if want_end else None
        if self.backend == "model" or self.kind not in OP_OF_KIND:
            done = [self._run_model(f, None if states is None else states[j], want_end) for j, f in enumerate(frags)]
            return [d[0] for d in done], ([d[1] for d in done] if want_end else None)
        t, lens, cu = self._select(frags)
        out, final = self._op(t, lens, cu, self._op_state(states), want_end)
        pieces = [self._to_model(p) for p in out.split(lens, dim=1)]
        return pieces, ([(e,) for e in final.split(1)] if want_end else None)

    def transitions(self, frags: Sequence[Any]) -> list[State]:
        kind, named = self.kind, self.named
        if not frags:
            return []
        if kind is K.DIAG:  # h_t = a_t h_{t-1} + x_t: the product of the fragment's a_t (no reset inside a fragment)
            gate = named["recurrent_gate"]
            return [(gate[f.row:f.row + 1, f.start:f.start + f.length].float().prod(1),) for f in frags]
        t, lens, cu = self._select(frags)
        if kind is K.SSD:
            m = torch.exp(ops.ssd_transition(t["dt"], named["A"], dt_bias=named.get("dt_bias"), cu_seqlens=cu,
                                             dt_softplus=bool(named.get("dt_softplus")), dt_limit=_limit(named)))
        elif kind is K.SELECTIVE:
            m = torch.exp(ops.selective_scan_transition(t["dt"], named["A"], delta_bias=named.get("delta_bias"),
                                                        delta_softplus=bool(named.get("delta_softplus")),
                                                        cu_seqlens=cu))
        else:
            helper = ops.gated_delta_rule_transition if kind is K.DELTA else ops.kda_transition
            m = helper(t["key"], t["g"], t["beta"], cu_seqlens=cu, seq_lens_host=lens, chunk_size=_CHUNK[kind],
                       use_qk_l2norm_in_kernel=bool(named.get("use_qk_l2norm_in_kernel")))
        return [(p.float(),) for p in m.split(1)]

    def tails(self, frags: Sequence[Any]) -> list[State]:
        x, k1 = self.named["hidden_states"], self.algebra.window  # [B, C, T]
        return [(WindowAlgebra.tail(x[f.row, :, f.start:f.start + f.length].t(), k1),) for f in frags]

    def partial(self, frags: Sequence[Any]) -> tuple[list, list[State], list[State], list]:
        if self.kind in (K.SSD, K.SELECTIVE):  # o(S) = o(0) + what S adds, read off the fragment's own inputs
            out0, ends = self.run(frags, None, True)
            return out0, ends, self.transitions(frags), list(frags)
        t, lens, cu = self._select(frags)
        v = t["value"]
        dk, dv, heads = t["key"].shape[-1], v.shape[-1], v.shape[2]
        aug = {**t, "query": t["query"].float(), "value": torch.cat([v.float(), v.new_zeros(*v.shape[:3], dk).float()],
                                                                      -1)}
        eye = torch.eye(dk, dtype=torch.float32, device=v.device).expand(len(lens), heads, dk, dk)
        out, final = self._op(aug, lens, cu, torch.cat([eye.new_zeros(len(lens), heads, dk, dv), eye], -1), True)
        o0, reads = out[..., :dv].split(lens, dim=1), out[..., dv:].split(lens, dim=1)
        ends = [(e[..., :dv],) for e in final.split(1)]
        trans = [(e[..., dv:],) for e in final.split(1)]
        return list(o0), ends, trans, list(reads)

    def correct(self, out: torch.Tensor, read: Any, state: State) -> torch.Tensor:
        if self.kind is K.SELECTIVE:
            return out + _selective_read(self.named, read, state[0])
        if self.kind is K.SSD:
            return out + _ssd_read(self.named, read, state[0])
        return (out + torch.einsum("bthk,hkv->bthv", read, state[0][0])).to(self.named["query"].dtype)

    def assemble(self, outputs: list[torch.Tensor], ends: list[State] | None) -> Any:
        spec, frags = self.spec, self._frags
        rows = []
        for b in range(self.batch[0]):
            pieces = [o for o, f in zip(outputs, frags) if f.row == b]
            rows.append(torch.cat(pieces, time_axis(pieces[0], spec.out_dim)) if len(pieces) > 1 else pieces[0])
        out = torch.cat(rows, 0) if len(rows) > 1 else rows[0]
        final = None
        if self.final and ends is not None:  # each row's last fragment's state, as the model's function leaves it
            last = [max(i for i, f in enumerate(frags) if f.row == b) for b in range(self.batch[0])]
            final = torch.cat([ends[i][0] for i in last], 0)
        if spec.returns_tuple:
            return out, final
        return (out, final) if self.final else out


def _selective_read(named: dict[str, Any], f: Any, state: torch.Tensor) -> torch.Tensor:
    """What Mamba1's entering state ``[1, D, N]`` adds to a fragment's outputs ``[1, D, T]``: ``C_t`` read of the
    state decayed by ``exp(A * sum_{s<=t} delta_s)``, gated by ``silu(z)`` like the scan's own output."""
    delta = named["dt"][f.row:f.row + 1].narrow(-1, f.start, f.length)
    if named.get("delta_bias") is not None:
        delta = delta + named["delta_bias"].to(delta.dtype)[..., None]
    if named.get("delta_softplus"):
        delta = torch.nn.functional.softplus(delta)
    c = named["C"][f.row:f.row + 1].narrow(-1, f.start, f.length).float()  # [1, N, T]
    decay = torch.exp(named["A"].float()[None, :, None, :] * delta.float().cumsum(-1)[..., None])  # [1, D, T, N]
    out = torch.einsum("bdtn,bnt,bdn->bdt", decay, c, state.float())
    z = named.get("z")
    if z is not None:
        out = out * torch.nn.functional.silu(z[f.row:f.row + 1].narrow(-1, f.start, f.length).float())
    return out.to(named["hidden_states"].dtype)


def _ssd_read(named: dict[str, Any], f: Any, state: torch.Tensor) -> torch.Tensor:
    """What Mamba2's entering state ``[1, H, P, N]`` adds to a fragment's outputs ``[1, T, H, P]`` (fp32, as
    transformers' torch scan returns them): ``C_t`` (its group's, per head) read of the state decayed by
    ``exp(A * sum_{s<=t} dt_s)``."""
    dt = named["dt"][f.row:f.row + 1, f.start:f.start + f.length]  # [1, T, H]
    dt = ops.discretised_dt(dt, named.get("dt_bias"), bool(named.get("dt_softplus")), _limit(named), torch.float32)
    decay = torch.exp((dt * named["A"].float()).cumsum(1))  # [1, T, H]
    c = named["C"][f.row:f.row + 1, f.start:f.start + f.length].float()  # [1, T, G, N]
    c = c.repeat_interleave(decay.shape[-1] // c.shape[2], dim=2)  # [1, T, H, N]
    return torch.einsum("bth,bthn,bhpn->bthp", decay, c, state.float())
