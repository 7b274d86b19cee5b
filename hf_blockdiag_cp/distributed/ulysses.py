"""The head all-to-all of a head-parallel (Ulysses) subgroup, differentiable, one fused buffer per call.

Inside a subgroup of ``u`` ranks each rank starts with its ``L`` tokens for all heads and ends with
all ``u * L`` tokens of the subgroup for its slice of heads (:class:`~hf_blockdiag_cp.planning.layout.HeadSplit`):

- :func:`heads_to_tokens`: ``q [B, Hq, L, D]``, ``k [B, Hkv, L, D]``, ``v [B, Hkv, L, Dv]`` ->
  ``q [B, Hq/u, u*L, D]``, ``k [B, n_kv, u*L, D]``, ``v [B, n_kv, u*L, Dv]``. The subgroup's tokens
  stand *rank-major*: head rank 0's ``L`` tokens, then head rank 1's, ... (with the layout plan's
  placement, their ascending global order).
- :func:`tokens_to_heads`: ``out [B, Hq/u, u*L, Dv]`` -> ``[B, Hq, L, Dv]``, the inverse.

q, k and v travel in ONE ``all_to_all_single`` (their bytes side by side, so mixed dtypes such as
autocast's float32 q/k with bfloat16 v move unchanged), the output in one, and each backward is the
reverse all-to-all of the gradients, one fused buffer again: a layer issues exactly one collective
per direction and pass, so ranks cannot pair different tensors' collectives (see
:mod:`.exchange`). When ``Hkv < u`` a K/V head is sent to every rank whose query heads use it, and
backward adds the gradients of those replicas into the head they came from. Splits are even, so
gloo runs it too. No host reads: every size is known from the shapes and the :class:`HeadA2A`.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..planning.fingerprint import fingerprint
from ..planning.layout import HeadSplit
from .exchange import CommStats, check_usable, failed, wait
from .groups import group_to_ref, ref_to_group

__all__ = ["HeadA2A", "UlyssesGroups", "create_ulysses_groups", "gather_heads", "heads_to_tokens", "new_subgroups",
           "scatter_heads", "subgroup_ranks", "tokens_to_heads"]


@dataclass(frozen=True, eq=False)
class HeadA2A:
    """One rank's head all-to-all, ready to run.

    Attributes:
        split: how the heads are cut over the subgroup (``split.ulysses_size`` ranks).
        head_rank: this rank's index inside the subgroup (``cp_rank % u``).
        group: the subgroup's process group (``u`` consecutive CP ranks).
        timeout: how long one collective may take (``BlockDiagCPConfig.collective_timeout_s``).
        kv_index: ``[u * n_kv]`` int64 K/V heads sent to each head rank in turn, on the K/V device
            (:meth:`HeadSplit.kv_index`).
        cp_rank: the rank in the CP group (error messages).
        stats: where moved bytes are recorded (``None``: not recorded).
    """

    split: HeadSplit
    head_rank: int
    group: object
    timeout: datetime.timedelta
    kv_index: torch.Tensor
    cp_rank: int
    stats: CommStats | None = None

    @classmethod
    def build(cls, split: HeadSplit, cp_rank: int, group: object, *, timeout_s: float | None = None,
              device: torch.device | str = "cpu", stats: CommStats | None = None,
              timeout: datetime.timedelta | None = None) -> HeadA2A:
        """Host-side construction, once per step (the only place ``kv_index`` is copied to ``device``);
        the head rank is ``cp_rank % u``. ``timeout`` (the step runtime's) or ``timeout_s`` seconds bound each
        collective."""
        if cp_rank < 0:
            raise ValueError(f"cp_rank={cp_rank} must be >= 0")
        if timeout is None:
            if timeout_s is None:
                raise TypeError("HeadA2A.build needs timeout= or timeout_s=")
            timeout = datetime.timedelta(seconds=timeout_s)
        index = torch.tensor(split.kv_index(), dtype=torch.int64, device=device)
        return cls(split, cp_rank % split.ulysses_size, group, timeout, index, cp_rank, stats)

    @property
    def size(self) -> int:
        return self.split.ulysses_size


def _all_to_all(chunks: list[torch.Tensor], ex: HeadA2A, what: str, phase: str) -> list[torch.Tensor]:
    """Send ``chunks[n][j]`` (each ``[u, ...]``, row ``j`` for head rank ``j``) in one fused buffer;
    returns tensors of the same shapes whose row ``j`` came from head rank ``j``."""
    u = ex.size
    # Byte views let tensors of different dtypes share one buffer without any conversion.
    flat = [c.contiguous().view(u, -1).view(torch.uint8) for c in chunks]
    widths = [f.shape[1] for f in flat]
    send = torch.cat(flat, dim=1)
    received = torch.empty_like(send)
    check_usable(ex.group, what, ex.cp_rank)
    try:
        work = dist.all_to_all_single(received, send, group=ex.group, async_op=True)
    except Exception as err:  # gloo raises here (not in wait) when a peer's connection is gone
        raise failed(ex.group, ex.cp_rank, what, "failed: a peer rank most likely failed first (see its log)",
                      err) from err
    wait(work, what, ex.cp_rank, ex.timeout, group=ex.group)
    if ex.stats is not None:
        moved = send[0].numel() * (u - 1)  # the rank's own row stays put
        ex.stats.record(phase, moved, moved)
    parts = torch.split(received, widths, dim=1)
    return [p.contiguous().view(c.dtype).view(c.shape) for p, c in zip(parts, chunks)]


def _by_destination(x: torch.Tensor, u: int) -> torch.Tensor:
    """``[B, u*h, L, d]`` (heads grouped by destination) -> ``[u, B, h, L, d]``."""
    b, heads, length, dim = x.shape
    return x.reshape(b, u, heads // u, length, dim).transpose(0, 1)


def _tokens_rank_major(x: torch.Tensor) -> torch.Tensor:
    """``[u, B, h, L, d]`` (row ``j`` from head rank ``j``) -> ``[B, h, u*L, d]``."""
    u, b, heads, length, dim = x.shape
    return x.permute(1, 2, 0, 3, 4).reshape(b, heads, u * length, dim)


def _split_tokens(x: torch.Tensor, u: int) -> torch.Tensor:
    """``[B, h, u*L, d]`` -> ``[u, B, h, L, d]`` (row ``j``: head rank ``j``'s tokens)."""
    b, heads, length, dim = x.shape
    return x.reshape(b, heads, u, length // u, dim).permute(2, 0, 1, 3, 4)


def _heads_concat(x: torch.Tensor) -> torch.Tensor:
    """``[u, B, h, L, d]`` (row ``j``: head rank ``j``'s heads) -> ``[B, u*h, L, d]``."""
    u, b, heads, length, dim = x.shape
    return x.transpose(0, 1).reshape(b, u * heads, length, dim)


def _scatter_heads(parts: list[torch.Tensor], ex: HeadA2A, what: str, phase: str) -> list[torch.Tensor]:
    """``[B, u*h, L, d]`` tensors -> ``[B, h, u*L, d]`` (the forward direction of q/k/v)."""
    out = _all_to_all([_by_destination(x, ex.size) for x in parts], ex, what, phase)
    return [_tokens_rank_major(x) for x in out]


def _gather_heads(parts: list[torch.Tensor], ex: HeadA2A, what: str, phase: str) -> list[torch.Tensor]:
    """``[B, h, u*L, d]`` tensors -> ``[B, u*h, L, d]`` (the forward direction of the output)."""
    out = _all_to_all([_split_tokens(x, ex.size) for x in parts], ex, what, phase)
    return [_heads_concat(x) for x in out]


def _check(name: str, x: torch.Tensor, heads: int, u: int, tokens: int | None = None) -> None:
    if x.dim() != 4 or x.shape[1] != heads or (tokens is not None and x.shape[2] % tokens):
        raise ValueError(f"{name} must be [B, {heads}, L, D] for this head split (ulysses_size={u}), "
                         f"got {tuple(x.shape)}")


class _HeadsToTokens(torch.autograd.Function):
    """``n_heads`` tensors split by head, then tensors split by K/V head (group), in one all-to-all each way."""

    @staticmethod
    def forward(ctx, ex: HeadA2A, n_heads: int, what: str, *tensors: torch.Tensor):  # type: ignore[override]
        ctx.ex, ctx.n_heads, ctx.what = ex, n_heads, what
        ctx.group_heads = [t.shape[1] for t in tensors[n_heads:]]
        # Replicated K/V heads (Hkv < u) are duplicated here, one copy per rank that uses them.
        parts = [*tensors[:n_heads], *(t.index_select(1, ex.kv_index) for t in tensors[n_heads:])]
        return tuple(_scatter_heads(parts, ex, f"{what} all-to-all", "forward"))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ex: HeadA2A = ctx.ex
        back = _gather_heads(list(grads), ex, f"{ctx.what} gradient all-to-all", "backward")
        # Every copy of a K/V head sent forward returns its gradient: they add up in the original head.
        grouped = [g.new_zeros(g.shape[0], heads, *g.shape[2:]).index_add_(1, ex.kv_index, g)
                   for g, heads in zip(back[ctx.n_heads:], ctx.group_heads)]
        return (None, None, None, *back[:ctx.n_heads], *grouped)


class _TokensToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ex: HeadA2A, what: str, *outs: torch.Tensor):  # type: ignore[override]
        ctx.ex, ctx.what = ex, what
        return tuple(_gather_heads(list(outs), ex, f"{what} all-to-all", "forward"))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        ex: HeadA2A = ctx.ex
        return (None, None, *_scatter_heads(list(grads), ex, f"{ctx.what} gradient all-to-all", "backward"))


def heads_to_tokens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ex: HeadA2A
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's ``L`` tokens with all heads -> the subgroup's ``u * L`` tokens with its heads.

    Args:
        q: ``[B, Hq, L, D]`` (any strides).
        k: ``[B, Hkv, L, D]``.
        v: ``[B, Hkv, L, Dv]``.
        ex: the rank's :class:`HeadA2A`.

    Returns ``q [B, Hq/u, u*L, D]``, ``k [B, n_kv, u*L, D]``, ``v [B, n_kv, u*L, Dv]``, tokens rank-major
    (``n_kv = ex.split.kv_per_rank``). ``u = 1`` returns the inputs unchanged, with no collective.
    """
    q, (k, v) = scatter_heads([q], [k, v], ex, names=("q", "k", "v"))
    return q[0], k, v


def tokens_to_heads(out: torch.Tensor, ex: HeadA2A) -> torch.Tensor:
    """The inverse of :func:`heads_to_tokens` for the attention output: ``[B, Hq/u, u*L, Dv]`` ->
    ``[B, Hq, L, Dv]`` (this rank's ``L`` tokens, all heads). ``u = 1``: ``out`` unchanged."""
    return gather_heads([out], ex, names=("out",), what="Ulysses output")[0]


def scatter_heads(heads: Sequence[torch.Tensor], groups: Sequence[torch.Tensor], ex: HeadA2A, *,
                  names: Sequence[str] | None = None, what: str = "Ulysses q/k/v"
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Any number of tensors in :func:`heads_to_tokens`' all-to-all (one fused buffer each way, gradients too).

    Args:
        heads: ``[B, Hq, L, d_i]`` tensors cut by head (``ex.split.num_q_heads``), like q.
        groups: ``[B, Hkv, L, d_j]`` tensors cut by K/V head (``ex.split.num_kv_heads``; replicated when
            ``Hkv < u``), like k and v.
        names: one name per tensor for shape errors; what: the collective's name in errors.

    Returns ``([B, Hq/u, u*L, d_i] ..., [B, n_kv, u*L, d_j] ...)``, tokens rank-major. Mixed dtypes travel
    unchanged. ``u = 1``: the inputs, no collective.
    """
    split, u = ex.split, ex.size
    names = names or [f"heads[{i}]" for i in range(len(heads))] + [f"groups[{j}]" for j in range(len(groups))]
    for name, x, count in zip(names, (*heads, *groups), [split.num_q_heads] * len(heads)
                              + [split.num_kv_heads] * len(groups)):
        _check(name, x, count, u)
    if u == 1:
        return list(heads), list(groups)
    out = _HeadsToTokens.apply(ex, len(heads), what, *heads, *groups)
    return list(out[:len(heads)]), list(out[len(heads):])


def gather_heads(outs: Sequence[torch.Tensor], ex: HeadA2A, *, names: Sequence[str] | None = None,
                 what: str = "Ulysses output") -> list[torch.Tensor]:
    """The inverse of :func:`scatter_heads` for outputs cut by head: ``[B, Hq/u, u*L, d_i]`` tensors ->
    ``[B, Hq, L, d_i]`` (this rank's ``L`` tokens, all heads), one fused all-to-all. ``u = 1``: unchanged."""
    u = ex.size
    names = names or [f"outs[{i}]" for i in range(len(outs))]
    for name, x in zip(names, outs):
        _check(name, x, ex.split.q_per_rank, u, tokens=u)
    if u == 1:
        return list(outs)
    return list(_TokensToHeads.apply(ex, what, *outs))


def subgroup_ranks(cp_ranks: Sequence[int], ulysses_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """``(head groups, sequence groups)`` of a CP group's global ranks ``cp_ranks`` (in CP order):
    head groups are ``u`` consecutive CP ranks, sequence groups the ``c`` ranks of equal ``r % u``."""
    ranks = list(cp_ranks)
    if ulysses_size < 1 or len(ranks) % ulysses_size:
        raise ValueError(f"ulysses_size={ulysses_size} does not divide the CP group size {len(ranks)}")
    u = ulysses_size
    heads = [ranks[g * u:(g + 1) * u] for g in range(len(ranks) // u)]
    sequence = [ranks[i::u] for i in range(u)]
    return heads, sequence


def new_subgroups(cp_groups: Sequence[Sequence[int]], ulysses_size: int, *, timeout_s: float,
                  backend: str | None = None) -> tuple[object, object]:
    """Create the head and sequence subgroups of every CP group (``cp_groups``: each CP group's global
    ranks, in CP order, e.g. every ``cp`` row of a ``("dp", "cp")`` mesh) and return this process's
    ``(head group, sequence group)`` (``None`` where it belongs to none).

    Collective over the default group: every process calls it with the same arguments (``new_group``
    must be entered by all processes in the same order). Create the groups of every ``u`` that
    ``auto`` may choose once, at setup, never per step. ``timeout_s`` is the groups' own timeout
    (connecting included): pass ``config.process_group_timeout.total_seconds()``, so that the
    package's shorter :class:`HeadA2A` timeout raises ``CollectiveError`` first.
    """
    me = dist.get_rank()
    mine: list[object] = [None, None]
    for ranks in cp_groups:
        heads, sequence = subgroup_ranks(ranks, ulysses_size)
        for slot, lists in enumerate((heads, sequence)):
            for members in lists:
                group = dist.new_group(members, timeout=datetime.timedelta(seconds=timeout_s), backend=backend)
                if me in members:
                    mine[slot] = group
    return mine[0], mine[1]


@dataclass(frozen=True, eq=False)
class UlyssesGroups:
    """This process's head-parallel and sequence subgroups, per ``ulysses_size`` they were created for.

    Attributes:
        groups: ``{u: (head group, sequence group)}`` (``u > 1``): the ``u`` consecutive CP ranks of this
            process and the ``P / u`` CP ranks of its head rank ``cp_rank % u``.

        tag: the same on every process for one :func:`create_ulysses_groups` call, different for another (a hash
            of the names of every process's subgroups): contexts compare it, so ranks holding subgroups created by
            different calls are refused before any all-to-all instead of waiting for each other. 0: not known.

    Pickles with the groups by name (DataLoader workers), like the context's CP group.
    """

    groups: dict[int, tuple[object, object]]
    tag: int = 0

    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.groups))

    def get(self, ulysses_size: int) -> tuple[object, object]:
        """``(head group, sequence group)`` for ``ulysses_size``; ``ValueError`` when not created."""
        if ulysses_size not in self.groups:
            raise ValueError(f"no head-parallel subgroups for ulysses_size={ulysses_size} were created (have: "
                             f"{list(self.sizes())}); create them at setup with hf_blockdiag_cp.ulysses_groups(mesh, "
                             f"sizes=...) for every ulysses_size a step may use")
        return self.groups[ulysses_size]

    def __reduce__(self):
        refs = {u: (group_to_ref(h), group_to_ref(s)) for u, (h, s) in self.groups.items()}
        return _resolve_groups, (refs, self.tag)


def _resolve_groups(refs: dict[int, tuple[object, object]], tag: int = 0) -> UlyssesGroups:
    return UlyssesGroups({u: (ref_to_group(h), ref_to_group(s)) for u, (h, s) in refs.items()}, tag)


def create_ulysses_groups(cp_groups: Sequence[Sequence[int]], sizes: Sequence[int], *, timeout_s: float,
                          backend: str | None = None) -> UlyssesGroups:
    """:func:`new_subgroups` for every ``u > 1`` in ``sizes`` (ascending): collective over the default
    group, at setup, with the same arguments on every process."""
    found = {}
    for u in sorted(set(sizes)):
        if u > 1:
            found[u] = new_subgroups(cp_groups, u, timeout_s=timeout_s, backend=backend)
    # One more collective of the same setup: every process learns every subgroup's name, so that all agree on a tag
    # that another creation (new names) does not share.
    own = sorted(getattr(g, "group_name", "") for pair in found.values() for g in pair if g is not None)
    names: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(names, own)
    tag = fingerprint(repr(sorted(name for each in names for name in each)).encode()) if found else 0
    return UlyssesGroups(found, tag)
