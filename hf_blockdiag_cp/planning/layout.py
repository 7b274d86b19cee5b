"""The 2-D layout of a CP group (head parallel x sequence parallel), planned on the host per step.

A CP group of ``P`` ranks splits as ``P = u x c``: ``c`` *sequence groups* of ``u`` consecutive ranks
each (rank ``r`` is in group ``g = r // u`` at head rank ``i = r % u``). The row's ``S`` tokens are
placed over the ``c`` groups (any :data:`~hf_blockdiag_cp.config.PLACEMENTS` kind, balanced by
default), each group holding a *super-shard* of ``u * L`` positions (``L = S / P``). Inside a group
rank ``i`` holds the ``i``-th run of ``L`` of its group's positions (ascending), so that after the
head all-to-all (:mod:`hf_blockdiag_cp.distributed.ulysses`) the group's tokens stand rank-major,
which is their ascending global order. Each rank then holds all ``u * L`` tokens of its group for
``Hq / u`` query heads and the K/V heads those use (:class:`HeadSplit`); with ``c > 1`` the K/V of
those heads that queries need from other groups move with today's needed-only exchange between the
``c`` ranks of equal head rank (``r % u``), planned here on the ``c``-rank placement.

``u = 1`` is sequence parallelism only (today's layout), ``u = P`` pure Ulysses.

Cost model (one layer, forward and backward, per rank; the step waits for the slowest rank)::

    cost(u) = 3.5 * 2 * (D + Dv) * W_max / C  +  2 * B_max / (C / F)

- ``W_max``: the most loaded rank's query-key pairs times its query heads (the causal work model of
  :mod:`.placement`: a query at in-document offset ``t`` attends ``min(t + 1, w)`` keys, averaged
  over the model's windows). ``2 * (D + Dv)`` FLOPs per pair and head forward (``QK^T`` and ``PV``);
  backward does 2.5 times that (five matrix products against two), hence 3.5.
- ``B_max``: the most bytes a rank moves in one direction per layer forward: the head all-to-all
  (q, k, v in, output back) plus ``max(sent, received)`` of the K/V exchange between groups
  (averaged over windows); backward moves the same again, hence 2. Collectives are not overlapped
  with attention in this package, so the terms add.
- ``C`` (``CostModel.compute_flops``, default 400 TFLOP/s): effective bf16 attention throughput of
  one H100/H200 (989 TFLOP/s dense peak; FlashAttention-2/3 reach roughly 350-600 in forward plus
  backward at head dim 128: 400 is a middle value). ``F`` (``BlockDiagCPConfig.layout_flops_per_byte``,
  default 400e12 / 450e9 = 889): FLOPs per byte moved; 450 GB/s is NVLink 4's bandwidth per
  direction per GPU (18 links x 25 GB/s). Real all-to-alls reach ~70-80 % of it, so the model
  slightly favours communication-heavy layouts; raise ``F`` for slower links (e.g. x 10 for
  400 Gb/s InfiniBand between nodes).

Head all-to-all elements a rank sends (and receives) per layer forward, with ``n_kv`` K/V heads
per rank (``Hkv / u``, or 1 when ``Hkv < u`` and K/V heads are replicated)::

    L * (u - 1) / u * (Hq * D + u * n_kv * (D + Dv) + Hq * Dv)

which for ``u = P``, ``Dv = D`` and ``Hkv % P == 0`` is ``(2 Hq + 2 Hkv) D L (P - 1) / P``.

``auto`` evaluates every valid ``u`` (divisors of ``P`` with ``Hq % u == 0`` and ``Hkv % u == 0`` or
``u % Hkv == 0``) in ascending order and keeps the first of least cost (ties go to the smaller
``u``: fewer collectives); the exchange between groups is the needed-only one that
``kv_exchange`` resolves to (``auto``: none / halo / a2a). Pure host arithmetic on the same inputs:
every rank chooses alike, and :meth:`LayoutPlan.key` goes into the step's plan fingerprint.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import DEFAULT_LAYOUT_FLOPS_PER_BYTE, BlockDiagCPConfig
from .documents import as_doc_ids
from .exchange import ExchangePlan, plan_exchange
from .placement import Placement, make_placement, rank_work
from .varlen import PlanError

__all__ = ["CostModel", "HeadShape", "HeadSplit", "LayoutCost", "LayoutPlan", "a2a_elements", "layout_costs",
           "plan_layout", "valid_ulysses_sizes"]

#: Backward attention FLOPs over forward ones (five matrix products against two).
BACKWARD_FACTOR = 2.5


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return value


@dataclass(frozen=True)
class HeadShape:
    """One attention layer's head geometry: ``Hq`` query heads, ``Hkv`` K/V heads, key dim ``D``,
    value dim ``Dv`` (``None``: ``D``)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    value_dim: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_q_heads", "num_kv_heads", "head_dim"):
            _positive(name, getattr(self, name))
        if self.value_dim is not None:
            _positive("value_dim", self.value_dim)
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"num_q_heads={self.num_q_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.value_dim is None else self.value_dim

@dataclass(frozen=True)
class HeadSplit:
    """How one layer's heads are cut over the ``u`` ranks of a head-parallel subgroup.

    Head rank ``i`` gets query heads ``[i * Hq/u, (i+1) * Hq/u)`` and the :meth:`kv_heads` they use:
    ``Hkv / u`` consecutive heads when ``Hkv % u == 0``, else (``u % Hkv == 0``) the one K/V head of
    its query heads, replicated on the ``u / Hkv`` ranks that share it. Either way a rank's local
    query head ``j`` uses its local K/V head ``j // (q_per_rank / kv_per_rank)`` (ordinary GQA).
    """

    ulysses_size: int
    num_q_heads: int
    num_kv_heads: int

    def __post_init__(self) -> None:
        u, hq, hkv = self.ulysses_size, self.num_q_heads, self.num_kv_heads
        _positive("ulysses_size", u)
        if hq % u:
            raise ValueError(f"ulysses_size={u} does not divide the model's num_attention_heads={hq}: every rank of "
                             "a head-parallel group needs the same number of query heads")
        if hq % hkv:
            raise ValueError(f"num_attention_heads={hq} is not a multiple of num_key_value_heads={hkv}")
        if hkv % u and u % hkv:
            raise ValueError(f"ulysses_size={u} and num_key_value_heads={hkv}: one must divide the other (K/V heads "
                             "are either split over the ranks or replicated on the ranks sharing them)")

    @property
    def q_per_rank(self) -> int:
        return self.num_q_heads // self.ulysses_size

    @property
    def kv_per_rank(self) -> int:
        return max(1, self.num_kv_heads // self.ulysses_size)

    @property
    def replicas(self) -> int:
        """Ranks holding each K/V head (1 unless ``Hkv < u``)."""
        return max(1, self.ulysses_size // self.num_kv_heads)

    def q_heads(self, head_rank: int) -> range:
        return range(head_rank * self.q_per_rank, (head_rank + 1) * self.q_per_rank)

    def kv_heads(self, head_rank: int) -> range:
        first = head_rank // self.replicas * self.kv_per_rank
        return range(first, first + self.kv_per_rank)

    def kv_index(self) -> tuple[int, ...]:
        """``[u * kv_per_rank]`` the K/V heads each head rank gets, concatenated in rank order."""
        return tuple(h for i in range(self.ulysses_size) for h in self.kv_heads(i))


def valid_ulysses_sizes(cp_size: int, heads: HeadShape) -> tuple[int, ...]:
    """Ascending ``u`` that divide ``cp_size`` and that :class:`HeadSplit` accepts for ``heads``."""
    _positive("cp_size", cp_size)
    return tuple(u for u in range(1, cp_size + 1) if cp_size % u == 0 and heads.num_q_heads % u == 0
                 and (heads.num_kv_heads % u == 0 or u % heads.num_kv_heads == 0))


def a2a_elements(local_len: int, heads: HeadShape, ulysses_size: int) -> int:
    """Elements one rank sends (and receives) in one layer's forward head all-to-alls: q, k, v in
    and the output back (module docstring's formula; exact, the buffers' own sizes)."""
    split = HeadSplit(ulysses_size, heads.num_q_heads, heads.num_kv_heads)
    u, d, dv = ulysses_size, heads.head_dim, heads.v_dim
    per_peer = split.q_per_rank * (d + dv) + split.kv_per_rank * (d + dv)  # q and output, k and v
    return local_len * (u - 1) * per_peer


@dataclass(frozen=True)
class CostModel:
    """Seconds of one layer's forward and backward: ``compute_flops`` FLOP/s of attention and
    ``compute_flops / flops_per_byte`` bytes/s per direction (module docstring)."""

    compute_flops: float = 400e12
    flops_per_byte: float = DEFAULT_LAYOUT_FLOPS_PER_BYTE

    def __post_init__(self) -> None:
        for name in ("compute_flops", "flops_per_byte"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name}={value!r} must be a positive finite number")

    @property
    def bandwidth(self) -> float:
        return self.compute_flops / self.flops_per_byte

    def seconds(self, flops: float, nbytes: float) -> float:
        """``flops`` forward attention FLOPs and ``nbytes`` bytes moved forward, fwd + bwd seconds."""
        return (1 + BACKWARD_FACTOR) * flops / self.compute_flops + 2 * nbytes / self.bandwidth


@dataclass(frozen=True)
class LayoutCost:
    """One candidate ``u``'s modelled numbers for one layer's forward (per rank, ranks in CP order).

    Attributes:
        ulysses_size / seq_groups: ``u`` and ``c = P / u``.
        kv_heads_per_rank: K/V heads each rank attends with (replicas included).
        work: ``[P]`` query-key pairs times query heads of each rank (mean over the windows).
        a2a_bytes: bytes each rank sends, and receives, in the head all-to-alls (0 for ``u = 1``).
        exchange_sent / exchange_received: ``[P]`` K/V exchange bytes between groups (mean over windows).
        strategies: the exchange strategy between groups, per window.
        flops_max: forward attention FLOPs of the most loaded rank.
        cost_s: modelled seconds of the layer's forward and backward (the slowest rank's FLOPs plus the
            most bytes a rank moves, :class:`CostModel`).
    """

    ulysses_size: int
    seq_groups: int
    kv_heads_per_rank: int
    work: tuple[float, ...]
    a2a_bytes: int
    exchange_sent: tuple[float, ...]
    exchange_received: tuple[float, ...]
    strategies: tuple[str, ...]
    flops_max: float
    cost_s: float

    @property
    def moved(self) -> tuple[float, ...]:
        """``[P]`` bytes each rank moves in its busier direction per layer forward."""
        return tuple(self.a2a_bytes + max(s, r) for s, r in zip(self.exchange_sent, self.exchange_received))

    @property
    def imbalance(self) -> float:
        """Max over mean work over ranks (1.0 when nothing is attended)."""
        mean = sum(self.work) / len(self.work)
        return max(self.work) / mean if mean else 1.0


@dataclass(frozen=True, eq=False)
class LayoutPlan:
    """The step's 2-D layout: the chosen ``u``, where every token is, and how K/V move between groups.

    Attributes:
        requested: the configured ``ulysses_size`` (an int or ``"auto"``).
        heads: the chosen :class:`HeadSplit`.
        cost: the chosen candidate's :class:`LayoutCost`.
        table: every evaluated candidate, ascending ``u`` (only the requested one unless ``auto``).
        group_placement: ``[c, u * L]`` positions of each sequence group (the ``c``-rank placement
            the varlen and exchange plans of a group are built on).
        placement: ``[P, L]`` positions of each rank before the head all-to-all: rank ``r`` holds
            run ``r % u`` of its group's positions (its ``local_index``).
        windows: the windows the exchanges were planned for.
        exchanges: per window, the ``c``-rank K/V exchange between groups (rank ``r`` runs
            ``exchanges[k].for_rank(r // u)`` with the ranks of equal ``r % u``).
        model: the cost model used.
    """

    requested: int | str
    heads: HeadSplit
    cost: LayoutCost
    table: tuple[LayoutCost, ...]
    group_placement: Placement
    placement: Placement
    windows: tuple[int | None, ...]
    exchanges: tuple[ExchangePlan, ...]
    model: CostModel

    @property
    def ulysses_size(self) -> int:
        return self.heads.ulysses_size

    @property
    def seq_groups(self) -> int:
        return self.group_placement.cp_size

    def position(self, rank: int) -> tuple[int, int]:
        """``(sequence group, head rank)`` of CP rank ``rank``."""
        return divmod(rank, self.ulysses_size)

    def exchange(self, window: int | None) -> ExchangePlan:
        """The between-group exchange planned for layers with ``window``."""
        if window not in self.windows:
            raise PlanError(f"no layout exchange planned for window={window!r} (planned: {self.windows})")
        return self.exchanges[self.windows.index(window)]

    def key(self) -> bytes:
        """What every rank must have chosen alike, for the step's plan fingerprint."""
        text = f"layout|{self.requested}|u={self.ulysses_size}|c={self.seq_groups}|{','.join(self.cost.strategies)}|"
        return text.encode() + self.placement.index.numpy().tobytes()

    def summary(self) -> str:
        """One line for logs: the choice and every candidate's modelled cost."""
        rows = ", ".join(f"u={c.ulysses_size}: {c.cost_s * 1e3:.3f} ms (imbalance {c.imbalance:.2f}, "
                         f"{max(c.moved) / 2**20:.1f} MiB)" for c in self.table)
        return f"ulysses_size={self.requested} -> u={self.ulysses_size} x c={self.seq_groups} [{rows}]"


def _row(doc_ids: torch.Tensor) -> torch.Tensor:
    ids = as_doc_ids(doc_ids)
    if ids.shape[0] != 1:
        raise PlanError(f"under context parallelism a micro-batch is one packed row (B=1), got B={ids.shape[0]}")
    return ids[0]


def _evaluate(row: torch.Tensor, cp_size: int, heads: HeadShape, u: int, windows: tuple[int | None, ...],
              config: BlockDiagCPConfig, dtype: torch.dtype, model: CostModel
              ) -> tuple[LayoutCost, Placement, tuple[ExchangePlan, ...]]:
    split = HeadSplit(u, heads.num_q_heads, heads.num_kv_heads)
    groups = cp_size // u
    element_size = torch.finfo(dtype).bits // 8
    group_placement = make_placement(row, groups, config.placement, tolerance=config.balance_tolerance,
                                     windows=windows)
    group_work = rank_work(row, group_placement, windows) * split.q_per_rank
    exchanges = tuple(plan_exchange(row, cp_size=groups, config=config, placement=group_placement, window=w)
                      for w in windows)
    # A K/V row between groups carries the rank's own heads only.
    row_bytes = split.kv_per_rank * (heads.head_dim + heads.v_dim) * element_size
    sent = [sum(plan.rows_sent(g) for plan in exchanges) * row_bytes / len(windows) for g in range(groups)]
    received = [sum(plan.rows_received(g) for plan in exchanges) * row_bytes / len(windows) for g in range(groups)]
    work = tuple(float(group_work[r // u]) for r in range(cp_size))
    flops_max = 2 * (heads.head_dim + heads.v_dim) * max(work)
    cost = LayoutCost(
        ulysses_size=u, seq_groups=groups, kv_heads_per_rank=split.kv_per_rank, work=work,
        a2a_bytes=a2a_elements(row.numel() // cp_size, heads, u) * element_size,
        exchange_sent=tuple(sent[r // u] for r in range(cp_size)),
        exchange_received=tuple(received[r // u] for r in range(cp_size)),
        strategies=tuple(str(plan.strategy) for plan in exchanges), flops_max=flops_max, cost_s=0.0)
    cost = dataclasses.replace(cost, cost_s=model.seconds(flops_max, max(cost.moved)))
    return cost, group_placement, exchanges


def _check_size(u: int, cp_size: int, heads: HeadShape) -> None:
    if cp_size % u:
        raise ValueError(f"ulysses_size={u} does not divide the CP group size {cp_size} (valid for these heads: "
                         f"{', '.join(map(str, valid_ulysses_sizes(cp_size, heads)))})")
    HeadSplit(u, heads.num_q_heads, heads.num_kv_heads)


def layout_costs(doc_ids: torch.Tensor, *, cp_size: int, heads: HeadShape, sizes: Sequence[int] | None = None,
                 windows: Sequence[int | None] = (None,), config: BlockDiagCPConfig | None = None,
                 dtype: torch.dtype = torch.bfloat16, model: CostModel | None = None) -> tuple[LayoutCost, ...]:
    """The :class:`LayoutCost` of each ``u`` in ``sizes`` (default: every valid one) for the row
    ``doc_ids [S]`` (simulation; :func:`plan_layout` is what a step uses)."""
    config = config or BlockDiagCPConfig()
    model = model or CostModel(flops_per_byte=config.layout_flops_per_byte)
    row, windows = _row(doc_ids), tuple(windows) or (None,)
    _check_row(row, cp_size)
    sizes = valid_ulysses_sizes(cp_size, heads) if sizes is None else tuple(sizes)
    for u in sizes:
        _check_size(u, cp_size, heads)
    return tuple(_evaluate(row, cp_size, heads, u, windows, config, dtype, model)[0] for u in sizes)


def _check_row(row: torch.Tensor, cp_size: int) -> None:
    _positive("cp_size", cp_size)
    if row.numel() % cp_size:
        raise PlanError(f"the row length S={row.numel()} is not divisible by cp_size={cp_size}")


def plan_layout(doc_ids: torch.Tensor, *, cp_size: int, heads: HeadShape, windows: Sequence[int | None] = (None,),
                config: BlockDiagCPConfig | None = None, dtype: torch.dtype = torch.bfloat16,
                model: CostModel | None = None) -> LayoutPlan:
    """Choose and plan the step's ``u x c`` layout for the row ``doc_ids [S]`` (or ``[1, S]``).

    Args:
        doc_ids: the full row's document ids (0 = padding), the same on every rank.
        cp_size: ``P``; ``S`` must be divisible by it.
        heads: the attention layers' head geometry.
        windows: every attention window of the model (``None`` = full causal layers).
        config: ``ulysses_size`` (an int or ``"auto"``), ``placement`` / ``balance_tolerance`` (of the
            ``c`` groups), ``kv_exchange`` (between groups), ``layout_flops_per_byte`` (cost model).
        dtype: dtype of q/k/v on the wire (bytes per element of the cost model).
        model: overrides the cost model built from ``config``.

    Raises ``ValueError`` naming the field when a requested ``u`` is invalid for ``P`` or the heads.
    """
    config = config or BlockDiagCPConfig()
    model = model or CostModel(flops_per_byte=config.layout_flops_per_byte)
    row, windows = _row(doc_ids), tuple(windows) or (None,)
    _check_row(row, cp_size)
    requested = config.ulysses_size
    sizes = valid_ulysses_sizes(cp_size, heads) if requested == "auto" else (requested,)
    for u in sizes:
        _check_size(u, cp_size, heads)
    best = None
    table = []
    for u in sizes:  # ascending: on a tie the smaller u (fewer collectives) stays
        found = _evaluate(row, cp_size, heads, u, windows, config, dtype, model)
        table.append(found[0])
        if best is None or found[0].cost_s < best[0].cost_s:
            best = found
    cost, group_placement, exchanges = best
    u = cost.ulysses_size
    placement = Placement(group_placement.kind, group_placement.index.reshape(cp_size, -1))
    return LayoutPlan(requested=requested, heads=HeadSplit(u, heads.num_q_heads, heads.num_kv_heads), cost=cost,
                      table=tuple(table), group_placement=group_placement, placement=placement, windows=windows,
                      exchanges=exchanges, model=model)
