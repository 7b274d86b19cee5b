"""Context parallelism for recurrent layers: fragment summaries in one all-gather per layer and direction.

Every rank runs the model's own function (:mod:`.install`) on each of its fragments from a zero state. A fragment
that a later fragment of its document follows (:class:`~hf_blockdiag_cp.planning.fragments.FragmentPlan`) sends
a summary of fixed size; a fragment that continues a document composes the summaries of the earlier fragments in
document order, in fp32, and is run again from the state so composed. Summaries (``W`` floats each):

- causal convolution (kernel ``K``, ``C`` channels): the fragment's last ``K - 1`` inputs, ``W = C (K - 1)``;
  the receiver concatenates the earlier fragments' windows (a fragment shorter than ``K - 1`` contributes its
  length) and keeps the last ``K - 1``, zeros before the document start;
- Mamba2 / SSD (``H`` heads, state ``[H, P, N]``): the end state from zero and the total decay
  ``exp(sum_t dt_t A)`` per head, ``W = H P N + H``; composed as ``S <- decay * S + S_0``;
- gated delta rule / KDA (state ``[H, Dk, Dv]``): the end state from zero and the transition ``M [H, Dk, Dk]``
  with ``S_end = M S_in + S_0``, ``W = H Dk Dv + H Dk Dk``; ``M`` is the model's own function run on the fragment
  with zero values and the identity as initial state (the map is linear in the state);
- diagonal linear recurrence (RecurrentGemma's RG-LRU, state ``[W_h]``): the end state from zero and the product
  of the fragment's decays ``prod_t a_t`` (the model's own scan on zero inputs from a state of ones),
  ``W = 2 W_h``; composed as ``h <- prod_a * h + h_0``;
- a module with its recurrence inside (MiniMax's lightning attention, state ``[H, D, D]``, per-token decay
  ``exp(-rate)`` per head): the end state its forward returns from zero and ``exp(-rate L)``, ``W = H D D + H``;
  composed as ``S <- decay S + S_0`` (:func:`run_stateful`).

Each rank sends ``slots`` summaries (the same on every rank, padded), so the all-gather has one fixed shape:
per layer and direction a rank sends ``(P - 1) * slots * W * 4`` bytes, whatever the row length. Autograd runs
through the gather (its backward is a reduce-scatter, :class:`~hf_blockdiag_cp.distributed.exchange._AllGather`),
through the composed states into the earlier fragments' inputs. Mamba1 (state ``[D, N]``, ``W = 2 D N``: end state
and ``exp(A sum_t delta_t)``): transformers' scan takes no initial state, so a continuing fragment adds the
incoming state's part ``C_t (exp(A cumsum delta) * S_in)`` (gated by ``silu(z)``) to its zero-state output.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import UnsupportedModel
from .fragment_call import call_fragment, time_axis
from .functions import ScanFunction, StatefulModule, WindowedModule
from .runs import LocalRuns
from .summaries import gather_summaries, run_with_summaries

__all__ = ["compose", "compose_stateful", "conv_incoming", "run_cp", "run_stateful", "run_window", "stateful_decay",
           "summary_width"]


def summary_width(spec: ScanFunction, named: dict[str, Any]) -> int:
    """``W``: floats in one fragment summary of this call (see the module docstring)."""
    if spec.kind == "conv":
        weight = named["weight"]
        return weight.shape[0] * (weight.shape[-1] - 1)
    if spec.kind == "ssd":
        x, b = named["hidden_states"], named["B"]
        heads = x.shape[2]
        return heads * x.shape[3] * b.shape[3] + heads
    if spec.kind == "selective":
        return 2 * named["A"].numel()
    if spec.kind == "diag":
        return 2 * named["hidden_states"].shape[-1]
    key, value = named["key"], named["value"]
    heads, dk, dv = value.shape[2], key.shape[3], value.shape[3]
    return heads * dk * dv + heads * dk * dk


def _selective_delta(named: dict[str, Any], row: int, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba1's step sizes ``[1, D, T]`` of a fragment, as transformers' selective scan derives them, and ``A``."""
    delta = named["dt"][row:row + 1].narrow(-1, start, length)
    if named.get("delta_bias") is not None:
        delta = delta + named["delta_bias"].to(delta.dtype)[..., None]
    if named.get("delta_softplus"):
        delta = torch.nn.functional.softplus(delta)
    return delta, named["A"]


def _selective_contribution(named: dict[str, Any], f: Any, state: torch.Tensor) -> torch.Tensor:
    """What Mamba1's incoming state ``[1, D, N]`` adds to a fragment's outputs ``[1, D, T]``: ``C_t`` read of the
    state decayed by ``exp(A * sum_{s<=t} delta_s)``, gated by ``silu(z)`` like the scan's own output."""
    delta, a = _selective_delta(named, f.row, f.start, f.length)
    c = named["C"][f.row:f.row + 1].narrow(-1, f.start, f.length).float()  # [1, N, T]
    decay = torch.exp(a.float()[None, :, None, :] * delta.float().cumsum(-1)[..., None])  # [1, D, T, N]
    out = torch.einsum("bdtn,bnt,bdn->bdt", decay, c, state.float())
    z = named.get("z")
    if z is not None:
        out = out * torch.nn.functional.silu(z[f.row:f.row + 1].narrow(-1, f.start, f.length).float())
    return out.to(named["hidden_states"].dtype)


def _state_shapes(spec: ScanFunction, named: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the end state and of the transition (per fragment, batch 1)."""
    if spec.kind == "selective":
        a = named["A"]
        return (1, *a.shape), (1, *a.shape)
    if spec.kind == "diag":
        width = named["hidden_states"].shape[-1]
        return (1, width), (1, width)
    if spec.kind == "ssd":
        x, b = named["hidden_states"], named["B"]
        return (1, x.shape[2], x.shape[3], b.shape[3]), (1, x.shape[2])
    key, value = named["key"], named["value"]
    return (1, value.shape[2], key.shape[3], value.shape[3]), (1, value.shape[2], key.shape[3], key.shape[3])


def _transition(spec: ScanFunction, original: Callable, named: dict[str, Any], row: int, start: int,
                length: int) -> torch.Tensor:
    """The fragment's state map as a tensor: SSD ``[1, H]`` decay, delta rule ``[1, H, Dk, Dk]`` ``M``, diagonal
    recurrence ``[1, W]`` ``prod_t a_t``."""
    end_shape, _ = _state_shapes(spec, named)
    if spec.kind == "selective":
        delta, a = _selective_delta(named, row, start, length)
        return torch.exp(a.float()[None] * delta.float().sum(-1)[..., None])  # [1, D, N]
    if spec.kind in ("ssd", "diag"):  # the model's own scan on zero inputs from a state of ones: the decay
        x = named["hidden_states"]
        zero = {"hidden_states": lambda t: torch.zeros_like(t)}
        ones = torch.ones(end_shape, dtype=torch.float32, device=x.device)
        _, end = call_fragment(spec, original, named, row, start, length, ones, True, zero)
        return end.float() if spec.kind == "diag" else end[..., 0, 0].float()
    key = named["key"]
    dk = key.shape[3]
    zero = {"value": lambda t: t.new_zeros(*t.shape[:3], dk)}
    eye = torch.eye(dk, dtype=torch.float32, device=key.device).expand(1, end_shape[1], dk, dk).contiguous()
    _, end = call_fragment(spec, original, named, row, start, length, eye, True, zero)
    return end.float()


def _conv_window(x: torch.Tensor, width: int) -> torch.Tensor:
    """The last ``width`` inputs of ``x [1, C, T]`` as ``[C, width]`` fp32, zeros on the left when ``T < width``."""
    tail = x[0, :, max(0, x.shape[-1] - width):].float()
    return torch.nn.functional.pad(tail, (width - tail.shape[-1], 0))


def run_cp(spec: ScanFunction, original: Callable, runs: LocalRuns, named: dict[str, Any]) -> Any:
    """One recurrent call on a CP shard (``runs.cp_size > 1``): see the module docstring."""
    plan, ctx = runs.plan, runs.context
    rank = ctx.cp_rank
    if spec.state_flag is not None and named.get(spec.state_flag):
        raise UnsupportedModel(f"{spec.name}: a final state (a cache) under context parallelism is not "
                                  "implemented; pass use_cache=False when training")
    frags = plan.fragments[rank]
    sources = plan.sources[rank]
    sending = set(plan.send[rank])
    width = summary_width(spec, named)
    outputs: dict[int, torch.Tensor] = {}
    summaries: dict[int, torch.Tensor] = {}  # by fragment index; sent in slot order (plan.send)
    for i, f in enumerate(frags):
        if spec.kind == "conv":
            if not f.continues:
                outputs[i], _ = call_fragment(spec, original, named, f.row, f.start, f.length)
            continue
        if f.continues and i not in sending and spec.kind != "selective":
            continue
        out, end = call_fragment(spec, original, named, f.row, f.start, f.length, None,
                                 True if i in sending else None)
        if not f.continues or spec.kind == "selective":  # Mamba1 adds the incoming state's part later
            outputs[i] = out
        if i in sending:
            summaries[i] = torch.cat([end.float().flatten(),
                                      _transition(spec, original, named, f.row, f.start, f.length).flatten()
                                      if f.continues else end.new_zeros(width - end.numel()).float()])
    if spec.kind == "conv":
        k1 = named["weight"].shape[-1] - 1
        x = named["hidden_states"]
        summaries = {i: _conv_window(x[frags[i].row:frags[i].row + 1].narrow(-1, frags[i].start, frags[i].length),
                                     k1).flatten() for i in plan.send[rank]}
    device = next(v for v in named.values() if isinstance(v, torch.Tensor)).device
    # slot k holds the summary of fragment plan.send[rank][k] (not fragment order: a rank's sent fragments are listed
    # by document, and balanced placements put a later document's piece first)
    gathered = gather_summaries(runs, [summaries[i] for i in plan.send[rank]], width, device)
    for i, srcs in sources.items():
        f = frags[i]
        rows = [gathered[r * plan.slots + s] for r, s in srcs]
        if spec.kind == "conv":
            outputs[i] = _continue_conv(spec, original, named, f, rows, [plan.fragments[r][plan.send[r][s]].length
                                                                         for r, s in srcs])
        elif spec.kind == "selective":
            outputs[i] = outputs[i] + _selective_contribution(named, f, compose(spec, named, rows))
        else:
            state = compose(spec, named, rows)
            # SSD and the diagonal recurrence keep their state in fp32; the delta rules take the values' dtype
            dtype = torch.float32 if spec.kind in ("ssd", "diag") else named["value"].dtype
            outputs[i], _ = call_fragment(spec, original, named, f.row, f.start, f.length, state.to(dtype))
    rows_out = []
    for row in range(runs.batch_size):
        pieces = [outputs[i] for i, f in enumerate(frags) if f.row == row]
        rows_out.append(torch.cat(pieces, dim=time_axis(pieces[0], spec.out_dim)) if len(pieces) > 1 else pieces[0])
    out = torch.cat(rows_out, dim=0) if len(rows_out) > 1 else rows_out[0]
    if gathered is not None:
        # Every rank must run the gather's backward (a collective), also one whose fragments use none of it.
        out = out + (gathered.sum() * 0).to(out.dtype)
    return (out, None) if spec.returns_tuple else out


def conv_incoming(rows: list[torch.Tensor], lengths: list[int], channels: int, k1: int) -> torch.Tensor:
    """The ``K - 1`` inputs ``[C, K - 1]`` (fp32, oldest first) before a continuing fragment: the earlier fragments'
    windows ``rows`` (each ``C (K - 1)`` floats) in document order, of which a fragment of ``n < K - 1`` tokens
    contributes its ``n``; zeros before the document start."""
    parts = [row.view(channels, k1)[:, k1 - min(n, k1):] for row, n in zip(rows, lengths)]
    window = torch.cat(parts, dim=-1)[:, -k1:] if parts else rows[0].new_zeros(channels, 0)
    return torch.nn.functional.pad(window, (k1 - window.shape[-1], 0))


def compose(spec: ScanFunction, named: dict[str, Any], rows: list[torch.Tensor]) -> torch.Tensor:
    """The state entering a fragment: the earlier fragments' summaries folded in document order (fp32)."""
    end_shape, transition_shape = _state_shapes(spec, named)
    n = 1
    for d in end_shape:
        n *= d
    state = None
    for summary in rows:
        end = summary[:n].view(end_shape)
        if state is None:  # the document's first fragment: its state from zero is the state
            state = end
            continue
        transition = summary[n:].view(transition_shape)
        if spec.kind == "ssd":
            state = transition[..., None, None] * state + end
        elif spec.kind in ("selective", "diag"):
            state = transition * state + end
        else:
            state = transition @ state + end
    return state


def _continue_conv(spec: ScanFunction, original: Callable, named: dict[str, Any], f: Any, rows: list[torch.Tensor],
                   lengths: list[int]) -> torch.Tensor:
    """The convolution of a continuing fragment: its inputs preceded by the document's last ``K - 1`` earlier ones."""
    weight = named["weight"]
    k1 = weight.shape[-1] - 1
    window = conv_incoming(rows, lengths, weight.shape[0], k1)
    x = named["hidden_states"][f.row:f.row + 1].narrow(-1, f.start, f.length)
    extended = torch.cat([window[None].to(x.dtype), x], dim=-1)
    out, _ = call_fragment(spec, original, {**named, "hidden_states": extended}, 0, 0, f.length + k1)
    return out[..., k1:]


def run_window(spec: WindowedModule, original: Callable, runs: LocalRuns, named: dict[str, Any],
               window: int) -> Any:
    """A windowed module (:class:`~.functions.WindowedModule`) once per fragment: its outputs (time axis
    ``spec.time_dim``), each cut to the ``T`` steps of its inputs.

    A fragment at its document's start runs alone (the module's own zero padding is the document start). Under CP
    a continuing fragment runs on the document's last ``min(window, earlier tokens)`` earlier inputs followed by its
    own, and drops the outputs of the former; those inputs are the summaries ``[window, C]`` of the earlier
    fragments (``W = window C`` floats, one all-gather per layer and direction as for the scans).
    """
    x = named[spec.sequence]  # [B, T, C] or, channels first, [B, C, T]
    mask = named.get(spec.mask) if spec.mask else None
    if mask is not None:  # the module zeroes padded inputs itself; the sent windows must be zeroed the same way
        x = x * mask[..., None].to(x.dtype)
        named = {**named, spec.sequence: x, spec.mask: None}
    seq = x if spec.time_dim == 1 else x.transpose(1, 2)  # [B, T, C]
    channels = seq.shape[-1]

    def call(inputs: torch.Tensor, drop: int) -> tuple:
        """The module on ``inputs [1, T', C]``: its outputs at steps ``[drop, T')``."""
        steps = inputs.shape[1]
        out = original(**{**named, spec.sequence: inputs if spec.time_dim == 1 else inputs.transpose(1, 2)})
        parts = out if isinstance(out, tuple) else (out,)
        return tuple(p.narrow(time_axis(p, spec.time_dim), drop, steps - drop) for p in parts)

    cp = runs.cp_size > 1
    frags = runs.plan.fragments[runs.context.cp_rank] if cp else runs.fragments
    outputs: dict[int, tuple] = {}
    for i, f in enumerate(frags):
        if not (cp and f.continues):
            outputs[i] = call(seq[f.row:f.row + 1, f.start:f.start + f.length], 0)
    if cp and runs.plan.slots:
        plan, ctx = runs.plan, runs.context
        rank = ctx.cp_rank
        sent = []
        for i in plan.send[rank]:
            f = frags[i]
            tail = seq[f.row, f.start + max(0, f.length - window):f.start + f.length].float()  # [<= window, C]
            sent.append(torch.nn.functional.pad(tail, (0, 0, window - tail.shape[0], 0)).flatten())
        gathered = gather_summaries(runs, sent, window * channels, x.device)  # [P * slots, window * C]
        for i, srcs in plan.sources[rank].items():
            f = frags[i]
            lengths = [plan.fragments[r][plan.send[r][s]].length for r, s in srcs]
            parts = [gathered[r * plan.slots + s].view(window, channels)[window - min(n, window):]
                     for (r, s), n in zip(srcs, lengths)]
            earlier = min(window, f.global_start - f.doc_start)
            history = torch.cat(parts)[-earlier:].to(x.dtype)[None]  # [1, earlier, C]
            outputs[i] = call(torch.cat([history, seq[f.row:f.row + 1, f.start:f.start + f.length]], 1), earlier)
        anchor = (gathered.sum() * 0)  # every rank runs the gather's backward, also one that uses none of it
    else:
        anchor = None
    rows = []
    for row in range(runs.batch_size):
        pieces = [outputs[i] for i, f in enumerate(frags) if f.row == row]
        rows.append(tuple(torch.cat(ps, time_axis(ps[0], spec.time_dim)) for ps in zip(*pieces)))
    out = tuple(torch.cat(ps, 0) for ps in zip(*rows))
    if anchor is not None:
        out = tuple(o + anchor.to(o.dtype) for o in out)
    return out if len(out) > 1 else out[0]


class _HandedState:
    """A stand-in cache that hands a :class:`~.functions.StatefulModule` the state entering its fragment (MiniMax's
    cache protocol: ``get_linear_cache(layer_idx)`` / ``set_linear_cache(layer_idx, state)``); the state it leaves
    is the forward's second output, so nothing is kept."""

    def __init__(self, state: torch.Tensor) -> None:
        self.state = state

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor:
        return self.state

    def set_linear_cache(self, layer_idx: int, state: torch.Tensor) -> None:
        pass


def _time_slice(value: Any, row: int, start: int, length: int) -> Any:
    """Rows ``[start, start + length)`` of batch row ``row`` of a ``[B, T, ...]`` tensor or a tuple of them."""
    if isinstance(value, torch.Tensor):
        return value[row:row + 1, start:start + length]
    if isinstance(value, (tuple, list)):
        return type(value)(_time_slice(v, row, start, length) for v in value)
    return value


def stateful_decay(spec: StatefulModule, module: torch.nn.Module, length: int) -> torch.Tensor:
    """``[H]`` fp32: how much a :class:`~.functions.StatefulModule`'s state decays over ``length`` tokens."""
    heads = int(getattr(module, spec.heads_attr))
    return torch.exp(-getattr(module, spec.rate_attr).float().reshape(heads) * length)


def compose_stateful(rows: list[torch.Tensor], heads: int, dim: int) -> torch.Tensor:
    """The state ``[1, H, D, D]`` entering a fragment from the summaries ``[H D D + H]`` (end state from zero, decay)
    of the earlier fragments in document order, in fp32: ``S <- decay S + S_0``."""
    state = None
    for row in rows:
        end = row[:heads * dim * dim].view(1, heads, dim, dim)
        state = end if state is None else row[heads * dim * dim:].view(1, heads, 1, 1) * state + end
    return state


def run_stateful(spec: StatefulModule, module: torch.nn.Module, original: Callable, runs: LocalRuns,
                 named: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A stateful module (:class:`~.functions.StatefulModule`) once per fragment: ``(out [B, T, C], ends)``, ``ends``
    ``[B, H, D, D]`` the end state of each row's last fragment (CP = 1; ``None`` under CP).

    Every fragment runs from a zero state (no cache). Under CP a continuing fragment runs again with a stand-in cache
    holding the state composed from the earlier fragments' summaries (the end state from zero and the decay
    ``exp(-rate L)`` per head, ``W = H D D + H`` floats; one all-gather per layer and direction as for the scans).
    """
    heads, dim = int(getattr(module, spec.heads_attr)), int(getattr(module, spec.dim_attr))
    rate = getattr(module, spec.rate_attr).float().reshape(heads)

    def call(f: Any, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        sub = {**named, **{n: _time_slice(named.get(n), f.row, f.start, f.length)
                           for n in (spec.sequence, *spec.time_args) if n in named}}
        sub[spec.cache] = None if state is None else _HandedState(state)
        out, end = original(**sub)[:2]
        return out, end

    def summarize(f: Any, end: torch.Tensor, continues: bool) -> torch.Tensor:
        decay = stateful_decay(spec, module, f.length) if continues else rate.new_zeros(heads)
        return torch.cat([end.float().flatten(), decay])

    out, ends = run_with_summaries(runs, heads * dim * dim + heads, named[spec.sequence].device, 1, call, summarize,
                                   lambda rows: compose_stateful(rows, heads, dim))
    if runs.cp_size > 1:
        return out, None
    return out, torch.cat([ends[row] for row in range(runs.batch_size)], 0)
