"""Cheap content hashes that CP ranks compare to detect that they hold different steps."""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..config import KV_EXCHANGES, PLACEMENTS, RECURRENT_LAYOUTS, BlockDiagCPConfig, backend_choices
from .documents import arange

__all__ = ["PLAN_FIELDS", "PlanFingerprint", "checksum_weights", "data_fingerprint", "describe_plan_field",
           "fingerprint", "plan_fingerprint", "shard_checksum"]


def fingerprint(*parts: bytes | memoryview | np.ndarray) -> int:
    """A 62-bit hash of the concatenated ``parts`` (fits an int64 tensor on every collective backend).

    Parts may be any C-contiguous buffer (a numpy view of a tensor): they are hashed in place, not copied.
    """
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        digest.update(part)
    return int.from_bytes(digest.digest(), "little") >> 2


#: What a rank's plan is made of, in the order the rank agreement exchanges it. The first five are the
#: requests themselves (small ints: an index into the config's choices, the tolerance's float64 bits),
#: so that a mismatch can be quoted with each rank's value; the rest are hashes of derived facts.
PLAN_FIELDS: tuple[str, ...] = ("cp_size", "placement", "balance_tolerance", "kv_exchange", "backend",
                                "sliding_windows", "placement_rows", "exchange_strategies", "ulysses_size", "layout",
                                "ulysses_groups", "recurrent_layout", "bidirectional_blocks")


class PlanFingerprint(int):
    """The plan fingerprint of a context: one int (what ranks compare) that also keeps the per-field
    values it was hashed from (:data:`PLAN_FIELDS`), so a mismatch can name the field that differs."""

    fields: dict[str, int]

    def __new__(cls, fields: dict[str, int]) -> PlanFingerprint:
        value = fingerprint(*(f"{name}={fields[name]};".encode() for name in PLAN_FIELDS))
        self = super().__new__(cls, value)
        self.fields = {name: int(fields[name]) for name in PLAN_FIELDS}
        return self

    def __reduce__(self):  # pickles (DataLoader workers) with its fields
        return PlanFingerprint, (self.fields,)


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def plan_fingerprint(config: BlockDiagCPConfig, *, cp_size: int, placement_kind: str, placement_rows: torch.Tensor,
                     windows: Sequence[int | None], strategies: Sequence[str], ulysses_size: int = 1,
                     layout: bytes | None = None, ulysses_groups: int = 0,
                     blocks: bytes | None = None) -> PlanFingerprint:
    """The fingerprint of what every CP rank must have planned alike.

    Args:
        config: the context's config (backend and ``kv_exchange`` requests, ``balance_tolerance``).
        cp_size: the context's CP size.
        placement_kind / placement_rows: the placement used: the ``Placement`` (hashed by its runs) or its
            ``[P, L]`` position table.
        windows / strategies: the planned sliding windows and each exchange's resolved strategy.
        ulysses_size / layout: the step's head-parallel size ``u`` and, when ``u > 1``, the bytes of its
            :meth:`~hf_blockdiag_cp.planning.layout.LayoutPlan.key` (``None``: 0, today's layout).
        ulysses_groups: the :attr:`~hf_blockdiag_cp.distributed.ulysses.UlyssesGroups.tag` of the head-parallel
            subgroups a ``u > 1`` step uses (0 without): the same on every rank only for one creation of them.
        blocks: the :meth:`~hf_blockdiag_cp.planning.blocks.BlockSpans.key` of the step's bidirectional blocks
            (``None``: 0, none): every rank's exchange covers the later keys of their blocks alike.
    """
    # The tolerance shapes only a balanced placement: other placements do not compare it (-1: no
    # float's bits, as tolerances are >= 0).
    tolerance = _float_bits(config.balance_tolerance) if placement_kind == "balanced" else -1
    return PlanFingerprint({
        "cp_size": cp_size,
        "placement": PLACEMENTS.index(placement_kind) if placement_kind in PLACEMENTS else fingerprint(
            placement_kind.encode()),
        "balance_tolerance": tolerance,
        "kv_exchange": KV_EXCHANGES.index(config.kv_exchange),
        "backend": backend_choices().index(config.backend),
        "sliding_windows": fingerprint(repr(tuple(windows)).encode()),
        "placement_rows": _placement_hash(placement_rows),
        "exchange_strategies": fingerprint(repr(tuple(strategies)).encode()),
        "ulysses_size": ulysses_size,
        "layout": 0 if layout is None else fingerprint(layout),
        "ulysses_groups": ulysses_groups,
        # Recurrent layers issue different collectives per layout (all-gather vs all-to-all): agreed like a request.
        "recurrent_layout": RECURRENT_LAYOUTS.index(config.recurrent_layout),
        "bidirectional_blocks": 0 if blocks is None else fingerprint(blocks),
    })


def _placement_hash(placement_rows: Any) -> int:
    """Hash of a placement: of its runs when it is a :class:`~hf_blockdiag_cp.planning.placement.Placement` (the
    runs are the table, in ``O(runs)`` bytes), else of the ``[P, L]`` table's bytes."""
    runs = getattr(placement_rows, "runs", None)
    if runs is not None:
        shape = repr((placement_rows.cp_size, placement_rows.local_len)).encode()
        return fingerprint(b"runs", shape, runs.start, runs.length, runs.rank, runs.local_start)
    return fingerprint(placement_rows.to(torch.int64).contiguous().numpy())


def describe_plan_field(name: str, value: int) -> str:
    """``value`` of plan field ``name`` as a user would write it (hashes are quoted as such)."""
    if name in ("cp_size", "ulysses_size"):
        return str(value)
    choices = {"placement": PLACEMENTS, "kv_exchange": KV_EXCHANGES, "backend": backend_choices(),
               "recurrent_layout": RECURRENT_LAYOUTS}.get(name)
    if choices is not None:
        return repr(choices[value]) if 0 <= value < len(choices) else f"another (hash {value:#x})"
    if name == "balance_tolerance":
        if value == -1:
            return "n/a (placement not balanced)"
        return f"{struct.unpack('<d', struct.pack('<q', value))[0]:g}"
    return f"hash {value:#x}"


#: Keeps a checksum non-negative (``-1`` means "not known" in the forward agreement).
_CHECKSUM_MASK = (1 << 62) - 1


#: Odd multiplier of the checksum's position weights (Knuth's multiplicative hash): ``i -> i * C mod 2**32`` is a
#: bijection of ``[0, 2**32)``, so no two positions of a row shorter than ``2**32`` share a weight.
_WEIGHT_MULTIPLIER = 2654435761
_WEIGHT_MASK = (1 << 32) - 1


def checksum_weights(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[length]`` int64 position weights of :func:`shard_checksum`: ``(i * 2654435761 mod 2**32) + 1``.

    A pure function of the position (every rank computes the same ones), distinct for every position below
    ``2**32`` (two tokens swapped anywhere in a shard change the sum), in ``[1, 2**32]``.
    """
    index = arange(length, device=device)
    # The product may pass 2**63 for i >= 2**32 / 0.62; its low 32 bits are exact whatever the wrap.
    return index.mul_(_WEIGHT_MULTIPLIER).bitwise_and_(_WEIGHT_MASK).add_(1)


def shard_checksum(values: torch.Tensor) -> torch.Tensor:
    """A position-weighted int64 checksum of an integer tensor, computed where ``values`` lives.

    The collator's host copy of a rank's shard and the tensor a forward actually receives (on its device)
    give the same value, so ranks can compare them without a host read of the batch. It is a checksum
    against edits and mix-ups, not a hash: ``sum((v + 1) * w(i)) * 1000003 + numel`` over the flattened
    tensor (``[B, L]`` rows in order), with the non-repeating weights of :func:`checksum_weights`, in int64
    arithmetic (wrapping) cut to 62 bits. Returns a 0-d int64 tensor.
    """
    flat = values.reshape(-1).to(torch.int64)
    if flat.device.type == "cpu":
        # The host copy (the collator's): one dot product with the cached weights. Integer sums wrap alike in
        # any order, so the low 62 bits equal the tensor formula's.
        weights = _row_weights(flat.numel())
        weighted = int(np.dot(flat.contiguous().numpy(), weights)) + int(weights.sum())
        return torch.tensor((weighted * 1000003 + flat.numel()) & _CHECKSUM_MASK, dtype=torch.int64)
    total = ((flat + 1) * checksum_weights(flat.numel(), flat.device)).sum() * 1000003 + flat.numel()
    return total.bitwise_and(_CHECKSUM_MASK)


@functools.lru_cache(maxsize=4)
def _row_weights(length: int) -> np.ndarray:
    """:func:`checksum_weights` as a read-only numpy array, cached: every step of a run has the same row length
    (the cache holds the last four lengths, 8 bytes per position: a row's and a shard's)."""
    weights = checksum_weights(length).numpy()
    weights.flags.writeable = False
    return weights


def data_fingerprint(doc_ids: torch.Tensor, input_ids: torch.Tensor | None = None) -> int:
    """The fingerprint of a step's rows that CP ranks compare: rows ``doc_ids [B, S]`` (CPU integers) as runs, and
    ``input_ids [B, S]`` (CPU int64, optional) by a position-weighted sum.

    Ranks with different document layouts (any id or boundary differs) disagree as surely as a 62-bit hash
    can tell; ranks with the same layout and different tokens disagree whenever the two rows' weighted sums
    differ: always for one changed token (its weight is odd-multiplied, non-zero and below ``2**33``, the
    change below ``2**30``), and for several changes unless ``sum(delta_i * w_i)`` vanishes modulo ``2**64``.
    Costs one comparison pass over the ids and one multiply-add pass over the tokens (the weights are cached),
    instead of hashing every byte of the rows.
    """
    batch, length = doc_ids.shape
    ids = doc_ids.reshape(-1).numpy()
    fresh = np.ones(ids.size, dtype=bool)
    if ids.size:
        fresh[1:] = ids[1:] != ids[:-1]
        fresh[::length] = True  # every batch row starts a run
    starts = np.flatnonzero(fresh)
    parts = [b"doc_runs", repr((batch, length)).encode(), starts.astype(np.int64), ids[starts].astype(np.int64)]
    if input_ids is not None:
        tokens = input_ids.reshape(-1).to(torch.int64).contiguous().numpy()
        # An int64 dot product wraps like the sum it stands for (numpy's integer dot has no overflow check).
        parts += [b"tokens", np.dot(tokens, _row_weights(tokens.size)).astype(np.int64).tobytes()]
    return fingerprint(*parts)
