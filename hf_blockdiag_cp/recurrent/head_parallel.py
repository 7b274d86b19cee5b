"""The head-parallel fallback for recurrent layers under CP (``BlockDiagCPConfig.recurrent_layout == "heads"``).

Instead of passing fragment summaries between the sequence shards (:mod:`.driver`), every rank gets the
WHOLE row for ``1 / P`` of the call's heads (channels of a causal convolution) and runs each document whole, as
at CP = 1; the outputs go back to the sequence shards. Per served call:

1. the time-axis inputs are cut by head and sent in ONE all-to-all over the CP group (the package's head
   all-to-all, :func:`~hf_blockdiag_cp.distributed.ulysses.scatter_heads`, gradients included): rank ``j``
   receives every rank's ``L`` tokens for heads ``[j H/P, (j+1) H/P)``, rank-major;
2. the ``P L`` tokens are put in row order (the placement's ``[P, L]`` table inverted, once per step);
3. the model's own function runs once per document (padding runs alone) on the row, with the per-head
   parameters of this rank's heads;
4. the output goes back to the placement's order and, by the inverse all-to-all, to this rank's tokens.

What is cut how (legend: ``T`` time, ``H`` heads, ``G`` groups of heads sharing an input):

- causal convolution ``causal_conv1d_fn``: ``hidden_states [B, C, T]`` by channel (``C % P == 0``), ``weight
  [C, K]`` / ``bias [C]`` sliced to the rank's channels;
- gated delta rule / KDA ``chunk_gated_delta_rule`` / ``chunk_kda``: ``value [B, T, Hv, Dv]``, ``g [B, T, Hv(, Dk)]``,
  ``beta [B, T, Hv]`` by value head (``Hv % P == 0``); ``query`` / ``key [B, T, Hk, Dk]`` by key head (a key head
  serves ``Hv / Hk`` consecutive value heads): split when ``Hk % P == 0``, sent whole to every rank that uses it
  when ``P % Hk == 0`` (the gradients of the copies add up), like K/V heads of the attention's head split;
- Mamba2 / SSD ``mamba_chunk_scan_combined``: ``hidden_states [B, T, H, P]``, ``dt [B, T, H]`` (and ``z``) by head,
  ``B`` / ``C [B, T, G, N]`` by group (split or replicated as above), ``A`` / ``D`` / ``dt_bias`` sliced;
- Mamba1 ``selective_scan_fn``: ``hidden_states`` / ``dt`` / ``z [B, D, T]`` by channel, ``B`` / ``C [B, N, T]``
  (shared by all channels: one group) sent whole to every rank, ``A [D, N]`` / ``D`` / ``delta_bias`` sliced.

Refused with the cause, on every rank at the same call before any collective: a head count the CP size does not
divide (or groups that neither divide nor are divided by it), and a call asking for a final state.
Windowed modules (:data:`~hf_blockdiag_cp.mixer_table.WINDOWED`) keep passing their last inputs
(:class:`~.module_runners.WindowRunner`,
exact, a few rows per fragment).

Bytes a rank sends per call and direction (``E``: bytes per element of each tensor, ``n_g = G / P`` or 1)::

    L (P - 1) / P * (sum over head-cut inputs of H d E  +  output H d_out E)  +  L (P - 1) * sum over group-cut
    inputs of n_g d E

(the backward moves the same again), recorded in the step's ``comm_stats`` like the K/V exchange.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..distributed.ulysses import HeadA2A, gather_heads, scatter_heads
from ..errors import UnsupportedModel
from ..planning.fragments import local_fragments
from ..planning.layout import HeadSplit
from ..runtime import step_runtime
from .kinds import MixerKind
from .runs import LocalRuns
from .scan_runner import ScanRunner
from .specs import ScanFunction

__all__ = ["HEAD_LAYOUTS", "HeadLayout", "head_parallel_bytes", "run_heads"]


@dataclass(frozen=True)
class HeadLayout:
    """How one kind of served call is cut by head: every entry is ``name -> (head axis, time axis)`` of the
    argument in the function's own layout (non-negative axes; trailing axes are features; head axis ``None``: an
    input shared by all heads, one group).

    Attributes:
        heads: inputs cut by head (all with the same head count ``H``); the first one fixes ``H``.
        groups: inputs cut by group of heads (all with the same count ``G``, ``H % G == 0``).
        params: per-head parameters (``[H, ...]``), sliced to the rank's heads.
        out: the output's ``(head axis, time axis)``.
    """

    heads: dict[str, tuple[int, int]]
    groups: dict[str, tuple[int | None, int]]
    params: tuple[str, ...]
    out: tuple[int, int]


_DELTA = HeadLayout(heads={"value": (2, 1), "g": (2, 1), "beta": (2, 1)},
                    groups={"query": (2, 1), "key": (2, 1)}, params=(), out=(2, 1))
#: The kinds of :data:`~hf_blockdiag_cp.mixer_table.SCANS` with a head-parallel fallback.
HEAD_LAYOUTS: dict[MixerKind, HeadLayout] = {
    MixerKind.CONV: HeadLayout(heads={"hidden_states": (1, 2)}, groups={}, params=("weight", "bias"), out=(1, 2)),
    MixerKind.DELTA: _DELTA,
    MixerKind.KDA: _DELTA,
    MixerKind.SSD: HeadLayout(heads={"hidden_states": (2, 1), "dt": (2, 1), "z": (2, 1)},
                      groups={"B": (2, 1), "C": (2, 1)}, params=("A", "D", "dt_bias"), out=(2, 1)),
    MixerKind.SELECTIVE: HeadLayout(heads={"hidden_states": (1, 2), "dt": (1, 2), "z": (1, 2)},
                            groups={"B": (None, 2), "C": (None, 2)}, params=("A", "D", "delta_bias"), out=(1, 2)),
}


def _to_rows(x: torch.Tensor, axes: tuple[int | None, int]) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``x`` -> ``[B, H, T, d]`` (features flattened; ``H = 1`` for an input without head axis) and the feature
    shape to restore."""
    head, time = axes
    if head is None:
        x, head, time = x.unsqueeze(1), 1, time + 1
    moved = x.movedim((head, time), (1, 2))
    return moved.reshape(*moved.shape[:3], -1), tuple(moved.shape[3:])


def _from_rows(y: torch.Tensor, axes: tuple[int | None, int], features: tuple[int, ...]) -> torch.Tensor:
    """The inverse of :func:`_to_rows`: ``[B, h, T, d]`` -> the function's own layout."""
    head, time = axes
    if head is None:
        return y.reshape(*y.shape[:3], *features).movedim((1, 2), (1, time + 1)).squeeze(1)
    return y.reshape(*y.shape[:3], *features).movedim((1, 2), (head, time))


def _present(named: dict[str, Any], table: dict[str, tuple[Any, int]]) -> dict[str, tuple[Any, int]]:
    return {name: axes for name, axes in table.items() if isinstance(named.get(name), torch.Tensor)}


def _split(spec: ScanFunction, named: dict[str, Any], size: int) -> tuple[HeadLayout, HeadSplit]:
    """The call's layout and head split over ``size`` ranks; refuses (on every rank alike) what cannot be cut."""
    layout = HEAD_LAYOUTS.get(spec.kind)
    if layout is None:
        raise UnsupportedModel(f"{spec.name}: recurrent_layout='heads' is not implemented for "
                               f"{str(spec.kind)!r} scans (no "
                               "head layout is declared for them); use recurrent_layout='state' (the default), which "
                               "passes their states between the sequence shards")
    if spec.state_flag is not None and named.get(spec.state_flag):
        raise UnsupportedModel(f"{spec.name}: a final state (a cache) under context parallelism is not implemented; "
                               "pass use_cache=False when training")
    heads = _present(named, layout.heads)
    counts = {name: named[name].shape[axes[0]] for name, axes in heads.items()}
    count = counts[next(iter(layout.heads))]
    groups = _present(named, layout.groups)
    group_counts = {name: 1 if axes[0] is None else named[name].shape[axes[0]] for name, axes in groups.items()}
    group_count = next(iter(group_counts.values()), count)
    what = "channels" if spec.kind in (MixerKind.CONV, MixerKind.SELECTIVE) else "heads"
    if len(set(counts.values())) > 1 or len(set(group_counts.values())) > 1 or count % group_count:
        raise UnsupportedModel(f"{spec.name}: recurrent_layout='heads' needs one head count per input kind, got "
                               f"{counts} and groups {group_counts}; use recurrent_layout='state'")
    if count % size:
        raise UnsupportedModel(f"{spec.name}: recurrent_layout='heads' splits the layer's {count} {what} over the "
                               f"{size} CP ranks, but {size} does not divide {count}; use recurrent_layout='state' "
                               "or a CP size that divides it")
    if group_count % size and size % group_count:
        raise UnsupportedModel(f"{spec.name}: recurrent_layout='heads' cuts the {group_count} groups of {count} "
                               f"{what} ({', '.join(groups)}) over {size} CP ranks, but neither divides the other; use "
                               "recurrent_layout='state'")
    for name in layout.params:
        value = named.get(name)
        if isinstance(value, torch.Tensor) and (value.dim() == 0 or value.shape[0] != count):
            raise UnsupportedModel(f"{spec.name}: its {name} has shape {tuple(value.shape)}, not one entry per "
                                   f"head ({count}); recurrent_layout='heads' cannot slice it, use 'state'")
    return layout, HeadSplit(size, count, group_count)


def _step_cache(runs: LocalRuns, split: HeadSplit, device: torch.device) -> tuple[HeadA2A, torch.Tensor, torch.Tensor,
                                                                                   tuple]:
    """This step's all-to-all for ``split`` on ``device``, the row order (``[S]``: rank-major index of each row
    position), the placement order (``[S]``: row position of each rank-major token) and the row's fragments."""
    ctx = runs.context
    runtime = step_runtime(ctx)
    cache = runtime.recurrent
    key = ("heads", device, split)
    found = cache.get(key)
    if found is None:
        placed = ctx.placement.index.reshape(-1).to(torch.int64)  # [P * L] row position of each rank-major token
        if ("rows", device) not in cache:
            cache[("rows", device)] = (torch.argsort(placed).to(device), placed.to(device),
                                       local_fragments(ctx.doc_ids, torch.arange(ctx.full_len)))
        a2a = HeadA2A.build(split, ctx.cp_rank, ctx.group, timeout=runtime.collective_timeout(ctx), device=device,
                            stats=runtime.comm)
        found = cache[key] = (a2a, *cache[("rows", device)])
    return found


def run_heads(spec: ScanFunction, original: Callable, runs: LocalRuns, named: dict[str, Any]) -> Any:
    """One served recurrent call on a CP shard under ``recurrent_layout="heads"`` (module docstring).

    Args:
        named: the call's arguments by name (packing keywords removed); time-axis inputs hold this rank's
            ``L`` local tokens of the one packed row (``B = 1``).
    """
    ctx = runs.context
    layout, split = _split(spec, named, ctx.cp_size)
    if runs.batch_size != 1:
        raise UnsupportedModel(f"{spec.name}: recurrent_layout='heads' runs one packed row per micro-batch (B=1), "
                               f"got B={runs.batch_size}")
    heads, groups = _present(named, layout.heads), _present(named, layout.groups)
    other = [name for name in spec.time_args if isinstance(named.get(name), torch.Tensor)
             and name not in heads and name not in groups]
    if other:  # a time-axis input the table does not cut would be read at row positions it does not hold
        raise UnsupportedModel(f"{spec.name}: recurrent_layout='heads' does not know how to cut its input(s) "
                               f"{other}; use recurrent_layout='state'")
    device = named[next(iter(heads))].device
    a2a, row_order, placed_order, rows = _step_cache(runs, split, device)
    head_in = {name: _to_rows(named[name], axes) for name, axes in heads.items()}
    group_in = {name: _to_rows(named[name], axes) for name, axes in groups.items()}
    sent_heads, sent_groups = scatter_heads([x for x, _ in head_in.values()], [x for x, _ in group_in.values()], a2a,
                                            names=[*head_in, *group_in], what=f"recurrent {spec.name} inputs")
    whole = dict(named)
    for (name, axes), x, (_, features) in zip((*heads.items(), *groups.items()), (*sent_heads, *sent_groups),
                                              (*head_in.values(), *group_in.values())):
        whole[name] = _from_rows(x.index_select(2, row_order), axes, features)  # rank-major -> row order
    first = a2a.head_rank * split.q_per_rank
    for name in layout.params:
        if isinstance(named.get(name), torch.Tensor):
            whole[name] = named[name].narrow(0, first, split.q_per_rank)
    runner = ScanRunner(spec, original, whole, "model", False, rows[0])  # each document whole, as at CP = 1
    out = runner.assemble(runner.run(rows[0], None, False)[0], None)
    out = out[0] if spec.returns_tuple else out
    out_rows, features = _to_rows(out, layout.out)
    back = gather_heads([out_rows.index_select(2, placed_order)], a2a, names=["out"],
                        what=f"recurrent {spec.name} output")[0]  # [1, H, L, d]
    result = _from_rows(back, layout.out, features)
    return (result, None) if spec.returns_tuple else result


def head_parallel_bytes(local_len: int, cp_size: int, heads: list[tuple[int, int, int]],
                        groups: list[tuple[int, int, int]], out: tuple[int, int, int]) -> int:
    """Bytes one rank sends in one served call's forward all-to-alls (module docstring's formula).

    Args:
        local_len: ``L``, tokens per rank; cp_size: ``P``.
        heads / groups: per input cut by head / by group, ``(count, features per head, bytes per element)``.
        out: the output's ``(heads, features per head, bytes per element)``.
    """
    p = cp_size
    sent = sum(h // p * d * e for h, d, e in (*heads, out)) * local_len * (p - 1)
    return sent + sum(max(1, g // p) * d * e for g, d, e in groups) * local_len * (p - 1)
