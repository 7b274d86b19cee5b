"""A served recurrent call computed by the package's ops (:mod:`.ops`) instead of the model's own function.

Legend: ``B`` batch rows, ``T`` local tokens per row, ``F`` fragments (all rows), ``T* = B T`` the rows laid end to
end. The call's time tensors are laid out as one packed row ``[1, T*, ...]`` (channels-first arguments of the
convolution and of Mamba1 are transposed to channels last), the fragments become the op's ``cu_seqlens``, and the
op's output is laid back out as the model's function returns it. So one op call replaces the per-fragment loop
(CP = 1). Under CP (:func:`run_cp_ops`), every rank

1. runs the fragments that start their document from a zero state in one call (their end states are summaries:
   the same as :mod:`.state_passing`'s, so the formula for the bytes moved is unchanged). Every delta-rule / KDA
   fragment that continues runs once here too, augmented (:func:`_augmented_pass`: its transition and what the
   incoming state adds to its outputs come out of the same call), so no rank waits after the gather while another
   runs its continuing fragments; an SSD / Mamba1 one that continues and sends runs from zero for its end state,
   with its decay from the op's transition helper (a sum), and again in step 3;
2. gathers the summaries (:func:`~.summaries.gather_summaries`, one all-gather per layer and direction);
3. runs the other continuing fragments (SSD, Mamba1) once, in one call, from the states composed in document order
   (:func:`~.state_passing.compose`), and adds ``S_in^T Q_t`` to the augmented ones.

The convolution's summary is its inputs, so it gathers first and runs every fragment once with its window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UnsupportedModel
from . import ops
from .functions import ScanFunction
from .ops.adapters import LIBRARY_OPS, library_unavailable_reason
from .runs import LocalRuns
from .state_passing import compose, conv_incoming, summary_width
from .summaries import gather_summaries

__all__ = ["OP_OF_KIND", "known_arguments", "run_cp_ops", "run_ops"]

#: The op behind each mixer kind (a key of :data:`~.ops.TORCH_OPS` and :data:`~.ops.adapters.LIBRARY_OPS`).
OP_OF_KIND: dict[str, str] = {"conv": "causal_conv1d", "ssd": "ssd_chunk_scan", "delta": "chunk_gated_delta_rule",
                              "kda": "chunk_kda", "selective": "selective_scan"}
#: The call's time tensors per kind, in the op's positional order, and whether they are channels first.
_TIME: dict[str, tuple[tuple[str, bool], ...]] = {
    "conv": (("hidden_states", True),),
    "selective": (("hidden_states", True), ("dt", True), ("B", True), ("C", True), ("z", True)),
    "ssd": (("hidden_states", False), ("dt", False), ("B", False), ("C", False)),
    "delta": tuple((n, False) for n in ("query", "key", "value", "g", "beta")),
    "kda": tuple((n, False) for n in ("query", "key", "value", "g", "beta")),
}
#: Arguments the op path maps, per kind, beyond the function's leading parameters: the rest must be absent/None.
_EXTRA_KNOWN: dict[str, frozenset[str]] = {
    "conv": frozenset(), "ssd": frozenset({"z"}), "delta": frozenset(), "kda": frozenset(),
    # transformers' Mamba1 scan: two torch algorithms of the same recurrence
    "selective": frozenset({"use_mambapy", "use_associative_scan"}),
}
#: Chunk sizes of the ops on CPU (``benchmarks/bench_recurrent_ops.py``); results do not depend on them.
_CHUNK: dict[str, int] = {"ssd": 256, "delta": 64, "kda": 64, "selective": 64}


def known_arguments(spec: ScanFunction) -> frozenset[str]:
    """Every argument of ``spec``'s calls that the op path reads."""
    return frozenset(spec.params) | _EXTRA_KNOWN.get(spec.kind, frozenset())



@dataclass(frozen=True)
class _Row:
    """The call's time tensors as one packed row (op layout), with what is needed to lay outputs back out."""

    tensors: dict[str, torch.Tensor]  # name -> [1, T*, ...]
    batch: int
    length: int


def _packed_row(spec: ScanFunction, named: dict[str, Any]) -> _Row:
    tensors = {}
    batch = length = 0
    for name, channels_first in _TIME[spec.kind]:
        t = named.get(name)
        if t is None:
            continue
        if channels_first:
            t = t.transpose(1, 2)  # [B, C, T] -> [B, T, C] (a view; the ops read it as is)
        batch, length = t.shape[:2]
        tensors[name] = t.reshape(1, batch * length, *t.shape[2:]) if batch > 1 else t
    return _Row(tensors, batch, length)


def _op(backend: str, kind: str, x: torch.Tensor, named: dict[str, Any], initial_state: torch.Tensor | None,
        final_needs_grad: bool) -> Any:
    """The op function for this call: the library adapter when ``backend`` names one that can run it, else torch."""
    name = OP_OF_KIND[kind]
    if backend in ("fla", "mamba_ssm"):
        reason = library_unavailable_reason(name, x, weight=named.get("weight"), activation=named.get("activation"),
                                            initial_state=initial_state, final_state_needs_grad=final_needs_grad)
        if reason is None:
            return LIBRARY_OPS[name]
    return ops.TORCH_OPS[name]


def _call(spec: ScanFunction, backend: str, named: dict[str, Any], t: dict[str, torch.Tensor], lens: list[int],
          initial_state: torch.Tensor | None, want_final: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The op on packed time tensors ``t`` (``[1, sum(lens), ...]``), one sequence per entry of ``lens``."""
    kind = spec.kind
    first = t[_TIME[kind][0][0]]
    cu = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(first.device)
    needs_grad = want_final and torch.is_grad_enabled()
    op = _op(backend, kind, first, named, initial_state, needs_grad)
    common = dict(initial_state=initial_state, output_final_state=want_final, cu_seqlens=cu, seq_lens_host=lens)
    if kind == "conv":
        return op(t["hidden_states"], named["weight"], named.get("bias"), named.get("activation"), **common)
    if kind == "ssd":
        limit = named.get("dt_limit")
        return op(t["hidden_states"], t["dt"], named["A"], t["B"], t["C"], D=named.get("D"),
                  dt_bias=named.get("dt_bias"), dt_softplus=bool(named.get("dt_softplus")),
                  dt_limit=(0.0, math.inf) if limit is None else tuple(limit), chunk_size=_CHUNK[kind], **common)
    if kind == "selective":
        return op(t["hidden_states"], t["dt"], named["A"], t["B"], t["C"], named.get("D"), t.get("z"),
                  named.get("delta_bias"), bool(named.get("delta_softplus")), chunk_size=_CHUNK[kind], **common)
    return op(t["query"], t["key"], t["value"], t["g"], t["beta"],
              use_qk_l2norm_in_kernel=bool(named.get("use_qk_l2norm_in_kernel")), chunk_size=_CHUNK[kind], **common)


def _transition(spec: ScanFunction, named: dict[str, Any], t: dict[str, torch.Tensor], lens: list[int]) -> torch.Tensor:
    """Each sequence's state map ``[N, ...]`` in :mod:`.state_passing`'s summary form: SSD the decay ``[N, H]``,
    Mamba1 ``exp(A sum delta)`` ``[N, D, S]``, delta rule / KDA ``M [N, H, Dk, Dk]``."""
    kind = spec.kind
    first = t[_TIME[kind][0][0]]
    cu = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(first.device)
    if kind == "ssd":
        limit = named.get("dt_limit")
        return torch.exp(ops.ssd_transition(t["dt"], named["A"], dt_bias=named.get("dt_bias"),
                                            dt_softplus=bool(named.get("dt_softplus")),
                                            dt_limit=(0.0, math.inf) if limit is None else tuple(limit),
                                            cu_seqlens=cu))
    if kind == "selective":
        return torch.exp(ops.selective_scan_transition(t["dt"], named["A"], delta_bias=named.get("delta_bias"),
                                                       delta_softplus=bool(named.get("delta_softplus")),
                                                       cu_seqlens=cu))
    helper = ops.gated_delta_rule_transition if kind == "delta" else ops.kda_transition
    return helper(t["key"], t["g"], t["beta"], cu_seqlens=cu, seq_lens_host=lens, chunk_size=_CHUNK[kind],
                  use_qk_l2norm_in_kernel=bool(named.get("use_qk_l2norm_in_kernel")))


def _unpack(spec: ScanFunction, named: dict[str, Any], row: _Row, out: torch.Tensor) -> torch.Tensor:
    """The op's output ``[1, T*, ...]`` in the layout and dtype the model's function returns."""
    kind = spec.kind
    out = out.reshape(row.batch, row.length, *out.shape[2:])
    if kind in ("conv", "selective"):
        out = out.transpose(1, 2)  # back to channels first
        if row.batch > 1:
            out = out.contiguous()
    if kind == "conv":
        return out.to(named["hidden_states"].dtype)
    if kind == "ssd":  # transformers' torch scan computes and returns fp32
        return out.float()
    if kind == "selective":  # its D skip (an fp32 D) promotes the output
        d = named.get("D")
        return out if d is None else out.to(torch.promote_types(out.dtype, d.dtype))
    return out.to(named["query"].dtype)


def _select(t: dict[str, torch.Tensor], index: torch.Tensor | None) -> dict[str, torch.Tensor]:
    return t if index is None else {k: v.index_select(1, index) for k, v in t.items()}


def _tokens(frags: list, length: int, device: torch.device) -> torch.Tensor:
    """Packed-row positions of the tokens of ``frags`` (in the given order)."""
    return torch.cat([torch.arange(f.row * length + f.start, f.row * length + f.start + f.length)
                      for f in frags]).to(device)


def run_ops(spec: ScanFunction, backend: str, runs: LocalRuns, named: dict[str, Any]) -> Any:
    """One served call through the op of ``backend`` (``"torch"``, ``"fla"`` or ``"mamba_ssm"``); returns what the
    model's function returns (``(out, state)`` where it would)."""
    if runs.cp_size > 1:
        return run_cp_ops(spec, backend, runs, named)
    row = _packed_row(spec, named)
    frags = runs.fragments
    want_state = bool(named.get(spec.state_flag)) if spec.state_flag else False
    out, final = _call(spec, backend, named, row.tensors, [f.length for f in frags], None, want_state)
    out = _unpack(spec, named, row, out)
    if want_state:  # the model path returns each row's last fragment's state
        last = [max(i for i, f in enumerate(frags) if f.row == b) for b in range(runs.batch_size)]
        final = final.index_select(0, torch.tensor(last, device=final.device))
    if spec.returns_tuple:
        return out, final if want_state else None
    return (out, final) if want_state else out


def _augmented_pass(spec: ScanFunction, backend: str, named: dict[str, Any], t: dict[str, torch.Tensor],
                    lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Delta rule / KDA fragments that continue, in one zero-state pass that also yields what the incoming
    state will add: the values get ``Dk`` zero columns and the initial state is ``[0 | I]``, so (the state map being
    linear) the extra state columns evolve as the transition ``M`` and the extra output columns are ``Q_t = M_t^T
    q_t`` (scaled), with ``o_t(S_in) = o_t(0) + S_in^T Q_t``. Returns (``o(0)`` [1, T, H, Dv] fp32, ``Q`` [1, T, H,
    Dk], end states from zero [n, H, Dk, Dv], ``M`` [n, H, Dk, Dk])."""
    v = t["value"]
    dk, dv, heads = t["key"].shape[-1], v.shape[-1], v.shape[2]
    aug = {**t, "query": t["query"].float(), "value": torch.cat([v.float(), v.new_zeros(*v.shape[:3], dk).float()], -1)}
    eye = torch.eye(dk, dtype=torch.float32, device=v.device).expand(len(lens), heads, dk, dk)
    init = torch.cat([eye.new_zeros(len(lens), heads, dk, dv), eye], -1)
    out, final = _call(spec, backend, named, aug, lens, init, True)
    return out[..., :dv], out[..., dv:], final[..., :dv], final[..., dv:]


def _scan_cp(spec: ScanFunction, backend: str, runs: LocalRuns, named: dict[str, Any], row: _Row, frags: list,
             width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scans under CP (see the module docstring): ``(out [1, T*, ...] in local order, gathered summaries)``."""
    plan, rank = runs.plan, runs.context.cp_rank
    sending = plan.send[rank]
    device = row.tensors[_TIME[spec.kind][0][0]].device
    send_pos = {i: s for s, i in enumerate(sending)}
    sources = plan.sources[rank]
    delta = spec.kind in ("delta", "kda")
    # delta rule / KDA: every continuing fragment runs once, augmented, BEFORE the gather (no transition pass, no
    # rerun); after it only the incoming state's part is added. Run after the gather, a continuing fragment would keep
    # the rank that sent its state idle meanwhile (the ranks would take turns on every layer).
    augmented = [i for i, f in enumerate(frags) if f.continues] if delta else []
    first_pass = [i for i, f in enumerate(frags) if (not f.continues or i in send_pos) and i not in augmented]
    later = [i for i in sorted(sources) if i not in augmented]
    pieces: dict[int, torch.Tensor] = {}  # fragment -> its final output [1, n, ...]
    summaries: list[torch.Tensor | None] = [None] * len(sending)

    def summarise(i: int, end: torch.Tensor, transition: torch.Tensor | None) -> None:
        state = end.float().flatten()
        tail = transition.float().flatten() if transition is not None else state.new_zeros(width - state.numel())
        summaries[send_pos[i]] = torch.cat([state, tail])

    def index(sel: list[int]) -> torch.Tensor | None:
        return None if sel == list(range(len(frags))) else _tokens([frags[i] for i in sel], row.length, device)

    if first_pass:
        lens = [frags[i].length for i in first_pass]
        want = any(i in send_pos for i in first_pass)
        out, end = _call(spec, backend, named, _select(row.tensors, index(first_pass)), lens, None, want)
        continuing = [i for i in first_pass if frags[i].continues]
        transitions = {}
        if continuing:  # Mamba2 / Mamba1 continuing senders: their decay (cheap), then a rerun below
            t = _select(row.tensors, index(continuing))
            m = _transition(spec, named, t, [frags[i].length for i in continuing])
            transitions = {i: m[j] for j, i in enumerate(continuing)}
        for j, (i, piece) in enumerate(zip(first_pass, out.split(lens, dim=1))):
            if not frags[i].continues:
                pieces[i] = piece
            if i in send_pos:
                summarise(i, end[j], transitions.get(i))
    corrections = {}
    if augmented:
        lens = [frags[i].length for i in augmented]
        o0, q_read, end, m = _augmented_pass(spec, backend, named, _select(row.tensors, index(augmented)), lens)
        for j, (i, o_i, q_i) in enumerate(zip(augmented, o0.split(lens, dim=1), q_read.split(lens, dim=1))):
            if i in send_pos:
                summarise(i, end[j], m[j])
            corrections[i] = (o_i, q_i)
    gathered = gather_summaries(runs, summaries, width, device)
    out_dtype = named["query"].dtype if delta else None
    for i, (o_i, q_i) in corrections.items():
        state = compose(spec, named, [gathered[r * plan.slots + s] for r, s in sources[i]])[0]  # [H, Dk, Dv]
        pieces[i] = (o_i + torch.einsum("bthk,hkv->bthv", q_i, state)).to(out_dtype)
    if later:
        states = [compose(spec, named, [gathered[r * plan.slots + s] for r, s in sources[i]])[0] for i in later]
        lens = [frags[i].length for i in later]
        out, _ = _call(spec, backend, named, _select(row.tensors, index(later)), lens, torch.stack(states), False)
        pieces.update(zip(later, out.split(lens, dim=1)))
    ordered = [pieces[i] for i in range(len(frags))]
    return (torch.cat(ordered, dim=1) if len(ordered) > 1 else ordered[0]), gathered


def run_cp_ops(spec: ScanFunction, backend: str, runs: LocalRuns, named: dict[str, Any]) -> Any:
    """One served call on a CP shard through the ops: see the module docstring."""
    plan, rank = runs.plan, runs.context.cp_rank
    if spec.state_flag is not None and named.get(spec.state_flag):
        raise UnsupportedModel(f"{spec.name}: a final state (a cache) under context parallelism is not "
                               "implemented; pass use_cache=False when training")
    row = _packed_row(spec, named)
    frags = list(plan.fragments[rank])
    sending = plan.send[rank]
    width = summary_width(spec, named)
    first = row.tensors[_TIME[spec.kind][0][0]]
    device = first.device
    if spec.kind == "conv":
        k1 = named["weight"].shape[-1] - 1
        x = first  # [1, T*, C]
        summaries = []
        for i in sending:
            f = frags[i]
            lo = f.row * row.length + f.start
            tail = x[0, lo + max(0, f.length - k1):lo + f.length].float().t()  # [C, <= K-1]
            summaries.append(torch.nn.functional.pad(tail, (k1 - tail.shape[-1], 0)).flatten())
        gathered = gather_summaries(runs, summaries, width, device)
        states = []
        channels = x.shape[-1]
        for i, f in enumerate(frags):
            srcs = plan.sources[rank].get(i)
            if srcs is None:
                states.append(x.new_zeros(channels, k1, dtype=torch.float32))
            else:
                states.append(conv_incoming([gathered[r * plan.slots + s] for r, s in srcs],
                                            [plan.fragments[r][plan.send[r][s]].length for r, s in srcs],
                                            channels, k1))
        out, _ = _call(spec, backend, named, row.tensors, [f.length for f in frags], torch.stack(states), False)
    else:
        out = _scan_cp(spec, backend, runs, named, row, frags, width)
        gathered = out[1]
        out = out[0]
    out = _unpack(spec, named, row, out)
    if gathered is not None:
        # Every rank must run the gather's backward (a collective), also one whose fragments use none of it.
        out = out + (gathered.sum() * 0).to(out.dtype)
    return (out, None) if spec.returns_tuple else out
