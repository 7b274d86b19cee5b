"""Differentiable K/V exchanges across the ranks of a CP group.

Each exchange moves one fused buffer ``kv [L, W]`` (a rank's K and V rows side by side,
``W = Hkv * (D + Dv)``), so a layer issues exactly one collective forward and one backward: with
separate K and V collectives, ranks can pair one tensor's backward collective with the other's
(measured on 4 gloo ranks with a tiny Llama: 0.58 relative gradient error with separate K and V
all-gathers, 2e-7 with one fused buffer).

Forward returns the rank's K/V buffer ``[R + L, W]``: the ``R`` rows received (in global order)
followed by its own ``L`` rows (all-gather returns all ``P * L`` rows). Backward sends the
gradients of the received rows back to their owners and accumulates them, so every rank's K/V
gradient is the sum over all ranks that used its rows.

Every collective is issued asynchronously and waited on with the config's timeout, so a rank
whose peer died raises a clear error instead of hanging. Before a message leaves, its size is checked
against the plan (:func:`check_message`): collectives pair by order and gloo accepts a shorter message
into a larger buffer, so a mismatch is refused on the host instead of being received as garbage.

A group whose collective failed or timed out is recorded as broken (:func:`mark_broken`, this module
owns the record); the next collective this package would issue on it raises :class:`CollectiveError`
at once (:func:`check_usable`) instead of entering gloo/NCCL again, where a group left mid-collective
can abort the process (SIGABRT) or pair with stale messages.
"""

from __future__ import annotations

import datetime
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import CollectiveError, ExchangeSizeError
from ..planning.exchange import RankTransfer, Strategy

__all__ = ["CollectiveError", "CommStats", "Deferred", "ExchangeSizeError", "GatherGroup", "RankExchange", "all_gather",
           "check_message", "check_sizes", "check_usable", "exchange_kv", "gradient_name", "mark_broken", "wait"]


# torch 2.13 renamed the single-tensor collectives (the old names warn); older torch has only those.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


#: What happened to each broken group: group -> description of the failure. The one record of broken
#: groups, owned by this module (weak keys: a destroyed group is forgotten with it).
_BROKEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_UNUSABLE = ("the CP process group cannot be used again after a failed collective (its peers are in an "
             "unknown state): do not catch this error and go on; end the job and restart it (e.g. from the "
             "last checkpoint)")


def _group_key(group):
    return dist.group.WORLD if group is None else group


def mark_broken(group, failure: str) -> None:
    """Record that a collective of ``group`` failed (``failure`` says which, on which rank)."""
    try:
        _BROKEN.setdefault(_group_key(group), failure)
    except TypeError:  # a stand-in that cannot be weakly referenced (tests' fakes): nothing to record
        pass


def check_usable(group, what: str, rank: int) -> None:
    """Raise :class:`CollectiveError` if ``group`` already had a failed collective (host-side lookup)."""
    try:
        failure = _BROKEN.get(_group_key(group))
    except TypeError:
        return
    if failure is not None:
        raise CollectiveError(f"CP rank {rank}: refusing to start the {what}: this CP group failed earlier "
                              f"({failure}); {_UNUSABLE}")


@dataclass
class CommStats:
    """Bytes this rank moved through K/V exchanges (forward and backward), owned by a step's runtime."""

    sent_bytes: int = 0
    received_bytes: int = 0
    forward_calls: int = 0
    backward_calls: int = 0
    per_call: list[tuple[str, int, int]] = field(default_factory=list)  # (phase, sent, received)
    #: seconds this rank waited for forward all-gathers to finish, by what they gather (after any overlapped work)
    waited_s: dict[str, float] = field(default_factory=dict)

    def record(self, phase: str, s: int, r: int) -> None:
        """Add ``s`` bytes sent and ``r`` bytes received by one forward or backward exchange."""
        self.sent_bytes += s
        self.received_bytes += r
        if phase == "forward":
            self.forward_calls += 1
        else:
            self.backward_calls += 1
        self.per_call.append((phase, s, r))

    def waited(self, what: str, seconds: float) -> None:
        """Add ``seconds`` this rank spent waiting for a forward ``what``."""
        self.waited_s[what] = self.waited_s.get(what, 0.0) + seconds


@dataclass(frozen=True, eq=False)
class RankExchange:
    """One rank's exchange, ready to run: its :class:`~hf_blockdiag_cp.planning.exchange.RankTransfer`
    plus what only the running process knows (device copy of the send rows, group, peers, timeout).

    Attributes:
        transfer: the rank's host-side numbers (strategy, splits, received rows).
        size: the CP group size ``P``.
        global_ranks: group rank -> global rank (point-to-point peers are global ranks).
        send_index: ``transfer.send_index`` on the K/V device (a2a).
        timeout: how long a collective may take.
        group: the CP process group.
        stats: where moved bytes are recorded (``None``: not recorded).
        row_width / dtype: the fused K|V row width ``W`` and dtype every rank of the group uses in this
            forward, when the ranks agreed on them; :func:`check_message` then refuses other messages
            (``None``: only the row counts, which the plan fixes on every rank, are checked).
    """

    transfer: RankTransfer
    size: int
    global_ranks: tuple[int, ...]
    send_index: torch.Tensor
    timeout: datetime.timedelta
    group: object
    stats: CommStats | None = None
    row_width: int | None = None
    dtype: torch.dtype | None = None

    @property
    def rank(self) -> int:
        return self.transfer.rank

    @property
    def recv_rows(self) -> int:
        return self.transfer.recv_rows

    @property
    def local_rows(self) -> int:
        """``L``: the rank's own K/V rows (its buffer holds ``recv_rows`` received rows before them)."""
        return self.transfer.buffer_positions.numel() - self.transfer.recv_rows


def failed(group, rank: int, what: str, cause: str, err: BaseException | None = None) -> CollectiveError:
    """Record ``group`` as broken and build the error for it."""
    mark_broken(group, f"the {what} on CP rank {rank} {cause}")
    detail = f" ({type(err).__name__}: {err})" if err is not None else ""
    return CollectiveError(f"CP rank {rank}: {what} {cause}{detail}; {_UNUSABLE}")


def wait(work, what: str, rank: int, timeout: datetime.timedelta, *, group) -> None:
    """Wait for an async collective of ``group``, turning failures and timeouts into :class:`CollectiveError`
    (and recording ``group`` as broken)."""
    limit = timeout.total_seconds()
    start = time.monotonic()
    try:
        ok = work.wait(timeout)
    except Exception as err:  # gloo/NCCL raise RuntimeError subclasses with transport details
        # gloo reports its own timeout as an exception ("Operation timed out!"), not as False.
        if time.monotonic() - start >= limit:
            raise failed(group, rank, what, f"did not finish within {limit:g} s: a peer rank stalled or failed "
                          "(see its log)", err) from err
        raise failed(group, rank, what, "failed: a peer rank most likely failed first (see its log)", err) from err
    if ok is False:
        raise failed(group, rank, what, f"did not finish within {limit:g} s: a peer rank stalled or failed "
                      "(see its log)")


class _Works:
    """Several async point-to-point works, waited as one (:func:`wait` takes it like a collective's work)."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self, timeout: datetime.timedelta) -> bool:
        return all(work.wait(timeout) is not False for work in self.works)


def _start_p2p(ops: list[tuple[str, torch.Tensor, int]], ex: RankExchange | GatherGroup, what: str) -> _Works:
    """Post ``ops`` (``("send" | "recv", tensor, group rank)``) at once; wait on the result."""
    p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, ex.global_ranks[peer], ex.group)
           for kind, tensor, peer in ops]
    try:
        return _Works(dist.batch_isend_irecv(p2p) if p2p else [])
    except Exception as err:  # gloo raises here (not in wait) when a peer's connection is gone
        raise failed(ex.group, ex.rank, what, "failed: a peer rank most likely failed first (see its log)",
                      err) from err


def _p2p(ops: list[tuple[str, torch.Tensor, int]], ex: RankExchange, what: str) -> None:
    if ops:
        wait(_start_p2p(ops, ex, what), what, ex.rank, ex.timeout, group=ex.group)


def _direct(ex: RankExchange | GatherGroup) -> bool:
    """Whether the backward of an all-gather of ``ex`` (a reduce-scatter) goes as direct sends to every peer: on
    gloo, whose reduce-scatter costs 2-3x more. ``python benchmarks/bench_exchange.py --no-timing --gathers`` (the
    package's all-gather, ``[2, 2000]`` fp32, per call, CPU / wall ms): backward direct 0.26 / 0.37 vs gloo's
    0.60-0.70 / 1.0 at P = 2, 1.2-1.5 / 2.6-3.1 vs 2.9 / 7.4-7.6 at P = 4; the forward stays gloo's all-gather, which
    direct sends did not beat (1.0 vs 0.6-0.9 ms CPU at P = 4). The bytes are the collective's."""
    if len(ex.global_ranks) != ex.size:
        return False
    try:
        return dist.get_backend(ex.group) == "gloo"
    except (RuntimeError, ValueError, TypeError, AttributeError):  # a stand-in group (tests' fakes): the collective
        return False


@dataclass(frozen=True)
class GatherGroup:
    """What an all-gather of fixed-shape buffers over a CP group reads (a :class:`RankExchange` has the same fields).

    Attributes:
        size: ``P``, the group's ranks; rank: this rank in it (error messages).
        group: the process group; timeout: how long one collective may take.
        stats: where moved bytes are recorded (``None``: not recorded).
        global_ranks: group rank -> global rank, for the direct sends on gloo (:func:`_direct`; empty: the collective).
    """

    size: int
    rank: int
    group: object
    timeout: datetime.timedelta
    stats: CommStats | None = None
    global_ranks: tuple[int, ...] = ()


def gradient_name(what: str) -> str:
    """The name of an all-gather's backward (``"K/V all-gather"`` -> ``"K/V gradient reduce-scatter"``)."""
    return f"{what.removesuffix('all-gather').strip()} gradient reduce-scatter"


class Deferred:
    """A forward all-gather started by :func:`all_gather` with ``deferred=``: its output is not to be read until
    :meth:`wait` returned (the caller runs work that does not need it meanwhile)."""

    def __init__(self) -> None:
        self._pending: tuple | None = None

    def wait(self) -> None:
        """Wait for the gather (a :class:`CollectiveError` naming it on failure or timeout); then its output holds
        every rank's rows. Idempotent."""
        if self._pending is None:
            return
        work, ex, what = self._pending
        self._pending = None
        _waited(work, ex, what)


def _waited(work, ex: RankExchange | GatherGroup, what: str) -> None:
    start = time.perf_counter()
    wait(work, what, ex.rank, ex.timeout, group=ex.group)
    if ex.stats is not None:
        ex.stats.waited(what, time.perf_counter() - start)


class _AllGather(torch.autograd.Function):
    """``[N, W]`` on every rank -> ``[P * N, W]`` (rank ``r``'s rows at ``r * N``); backward: a reduce-scatter.
    ``what`` names both directions in errors (:func:`gradient_name`); with a :class:`Deferred`, the forward returns
    at once and the deferred's ``wait`` finishes it."""

    @staticmethod
    def forward(ctx, buf: torch.Tensor, ex: RankExchange | GatherGroup,  # type: ignore[override]
                what: str = "K/V all-gather", deferred: Deferred | None = None) -> torch.Tensor:
        buf = buf.contiguous()
        out = buf.new_empty(ex.size * buf.shape[0], buf.shape[1])
        work = all_gather_single(out, buf, group=ex.group, async_op=True)
        if deferred is None:
            _waited(work, ex, what)
        else:
            deferred._pending = (work, ex, what)
        ctx.ex, ctx.what = ex, what
        if ex.stats is not None:
            moved = buf.nbytes * (ex.size - 1)
            ex.stats.record("forward", moved, moved)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ex: RankExchange | GatherGroup = ctx.ex
        backward_what = gradient_name(ctx.what)
        check_usable(ex.group, backward_what.replace("reduce-scatter", "exchange"), ex.rank)
        grad = grad.contiguous()
        n = grad.shape[0] // ex.size
        if _direct(ex):
            peers = [p for p in range(ex.size) if p != ex.rank]
            parts = {p: grad.new_empty(n, grad.shape[1]) for p in peers}
            work = _start_p2p([("send", grad[p * n:(p + 1) * n], p) for p in peers] +
                              [("recv", parts[p], p) for p in peers], ex, backward_what)
            wait(work, backward_what, ex.rank, ex.timeout, group=ex.group)
            # summed in rank order, own rows in their place (as a reduce-scatter adds them)
            out = sum((grad[p * n:(p + 1) * n] if p == ex.rank else parts[p] for p in range(ex.size)),
                      grad.new_zeros(n, grad.shape[1]))
        else:
            out = grad.new_empty(n, grad.shape[1])
            work = reduce_scatter_single(out, grad, op=dist.ReduceOp.SUM, group=ex.group, async_op=True)
            wait(work, backward_what, ex.rank, ex.timeout, group=ex.group)
        if ex.stats is not None:
            moved = out.nbytes * (ex.size - 1)
            ex.stats.record("backward", moved, moved)
        return out, None, None, None


def all_gather(buf: torch.Tensor, on: GatherGroup, what: str, deferred: Deferred | None = None) -> torch.Tensor:
    """Differentiable all-gather of fixed-shape ``buf [N, W]`` (the same shape on every rank) -> ``[P * N, W]``.

    Raises :class:`CollectiveError` naming ``what`` at once when the group failed earlier, or when a peer fails or
    stalls; its backward (a reduce-scatter, summing every rank's gradient of this rank's rows) is named after it.
    With ``deferred``, returns as soon as the gather started: read the result only after ``deferred.wait()``
    (which raises those errors), and leave ``buf`` unchanged until then.
    """
    check_usable(on.group, what, on.rank)
    if buf.dim() != 2:
        raise ExchangeSizeError(f"CP rank {on.rank}: the {what} sends [N, W] buffers, got shape {tuple(buf.shape)}")
    return _AllGather.apply(buf, on, what, deferred)


class _Halo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv: torch.Tensor, ex: RankExchange) -> torch.Tensor:  # type: ignore[override]
        send = ex.transfer.send_splits[ex.rank + 1] if ex.rank + 1 < ex.size else 0
        recv = ex.recv_rows
        received = kv.new_empty(recv, kv.shape[1])
        ops = []
        if send:
            ops.append(("send", kv[kv.shape[0] - send:].contiguous(), ex.rank + 1))
        if recv:
            ops.append(("recv", received, ex.rank - 1))
        _p2p(ops, ex, "K/V halo exchange")
        ctx.ex, ctx.send = ex, send
        if ex.stats is not None:
            ex.stats.record("forward", kv[kv.shape[0] - send:].nbytes if send else 0, received.nbytes)
        return torch.cat([received, kv], dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ex: RankExchange = ctx.ex
        check_usable(ex.group, "K/V gradient exchange", ex.rank)
        send, recv = ctx.send, ex.recv_rows
        grad_local = grad[recv:].clone()
        returned = grad.new_empty(send, grad.shape[1])
        ops = []
        if recv:
            ops.append(("send", grad[:recv].contiguous(), ex.rank - 1))
        if send:
            ops.append(("recv", returned, ex.rank + 1))
        _p2p(ops, ex, "K/V halo gradient exchange")
        if send:
            grad_local[grad_local.shape[0] - send:] += returned
        if ex.stats is not None:
            ex.stats.record("backward", grad[:recv].nbytes, returned.nbytes)
        return grad_local, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv: torch.Tensor, ex: RankExchange) -> torch.Tensor:  # type: ignore[override]
        sent = kv.index_select(0, ex.send_index) if ex.send_index.numel() else kv.new_empty(0, kv.shape[1])
        received = kv.new_empty(ex.recv_rows, kv.shape[1])
        work = dist.all_to_all_single(received, sent, output_split_sizes=list(ex.transfer.recv_splits),
                                      input_split_sizes=list(ex.transfer.send_splits), group=ex.group, async_op=True)
        wait(work, "K/V all-to-all", ex.rank, ex.timeout, group=ex.group)
        ctx.ex = ex
        if ex.stats is not None:
            ex.stats.record("forward", sent.nbytes, received.nbytes)
        return torch.cat([received, kv], dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ex: RankExchange = ctx.ex
        check_usable(ex.group, "K/V gradient exchange", ex.rank)
        recv = ex.recv_rows
        returned = grad.new_empty(ex.send_index.numel(), grad.shape[1])
        work = dist.all_to_all_single(returned, grad[:recv].contiguous(),
                                      output_split_sizes=list(ex.transfer.send_splits),
                                      input_split_sizes=list(ex.transfer.recv_splits), group=ex.group, async_op=True)
        wait(work, "K/V gradient all-to-all", ex.rank, ex.timeout, group=ex.group)
        grad_local = grad[recv:].clone()
        if returned.numel():
            # A row may have gone to several ranks: their gradients add up.
            grad_local.index_add_(0, ex.send_index, returned)
        if ex.stats is not None:
            ex.stats.record("backward", grad[:recv].nbytes, returned.nbytes)
        return grad_local, None


_FUNCTIONS: dict[Strategy, type[torch.autograd.Function]] = {
    Strategy.ALLGATHER: _AllGather,
    Strategy.HALO: _Halo,
    Strategy.A2A: _AllToAll,
}


_WHAT = {Strategy.ALLGATHER: "K/V all-gather", Strategy.HALO: "K/V halo exchange", Strategy.A2A: "K/V all-to-all"}


def check_message(kv: torch.Tensor, ex: RankExchange) -> None:
    """Raise :class:`ExchangeSizeError` before anything is sent when ``kv [L, W]`` or the rank's splits
    cannot match the buffers its peers post for it (host-side attribute reads only; :func:`check_sizes`)."""
    check_sizes(kv.shape, kv.dtype, ex)


def check_sizes(shape: torch.Size, dtype: torch.dtype, ex: RankExchange) -> None:
    """:func:`check_message` on a message's ``shape`` and ``dtype``: what the check reads of it.

    Every rank derives the same per-pair row counts from the plan; a message of another size would be
    paired by order with a receive of the planned size, and gloo accepts a shorter message into a larger
    buffer. The backward pass sends gradients whose shape autograd ties to the forward's output, so
    checking the forward message covers both directions.
    """
    t = ex.transfer
    what = _WHAT[t.strategy]
    local, width = ex.local_rows, (shape[1] if len(shape) == 2 else None)
    if len(shape) != 2 or shape[0] != local:
        raise ExchangeSizeError(f"CP rank {ex.rank}: the {what} would cut its messages from K/V rows "
                                f"{tuple(shape)} {dtype}, but "
                                f"the plan gives this rank {local} local rows, and its peers post buffers for that; "
                                "refused before sending (were the local keys changed after the context was built?)")
    if ex.row_width is not None and (width != ex.row_width or (ex.dtype is not None and dtype != ex.dtype)):
        raise ExchangeSizeError(f"CP rank {ex.rank}: the {what} would send rows of width {width} ({dtype}), but "
                                f"every rank of the group agreed on width {ex.row_width} ({ex.dtype}) for this "
                                "forward; refused before sending")
    size, rank = ex.size, ex.rank
    if t.strategy == Strategy.ALLGATHER:
        problems = [] if t.recv_rows == (size - 1) * local else [f"receives {t.recv_rows} rows, not (P - 1) * L = "
                                                                 f"{(size - 1) * local}"]
    else:
        problems = [f"{name} has {len(splits)} entries for {size} ranks" for name, splits in
                    (("send_splits", t.send_splits), ("recv_splits", t.recv_splits)) if len(splits) != size]
        if not problems:
            peers = [(p, t.send_splits[p]) for p in range(size) if t.send_splits[p]]
            problems += [f"sends {n} rows to rank {p}, more than its {local} rows" for p, n in peers if n > local]
            problems += [f"sends {n} rows to itself" for p, n in peers if p == rank]
            if t.strategy == Strategy.HALO:
                problems += [f"sends {n} rows to rank {p}, not its successor" for p, n in peers if p != rank + 1]
                problems += [f"receives {n} rows from rank {p}, not its predecessor"
                             for p, n in enumerate(t.recv_splits) if n and p != rank - 1]
            elif sum(t.send_splits) != t.send_index.numel():
                problems.append(f"sends {sum(t.send_splits)} rows by its splits but indexes {t.send_index.numel()}")
            if sum(t.recv_splits) != t.recv_rows:
                problems.append(f"receives {sum(t.recv_splits)} rows by its splits into a buffer of {t.recv_rows}")
    if problems:
        raise ExchangeSizeError(f"CP rank {rank}: the {what} plan does not fit its peers' buffers ("
                                f"{'; '.join(problems)}; rows of width {width}); refused before sending")


def exchange_kv(kv: torch.Tensor, ex: RankExchange) -> torch.Tensor:
    """``kv [L, W]`` local fused K|V rows -> ``[R + L, W]`` (``[P * L, W]`` for all-gather) buffer.

    Raises :class:`CollectiveError` at once when the group failed earlier, and
    :class:`ExchangeSizeError` before sending a message whose size the plan does not give it."""
    what = _WHAT[ex.transfer.strategy]
    check_usable(ex.group, what, ex.rank)
    check_sizes(kv.shape, kv.dtype, ex)
    return _FUNCTIONS[ex.transfer.strategy].apply(kv, ex)
