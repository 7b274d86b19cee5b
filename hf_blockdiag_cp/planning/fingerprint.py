"""Cheap content hashes that CP ranks compare to detect that they hold different steps."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

from ..config import KV_EXCHANGES, PLACEMENTS, BlockDiagCPConfig, backend_choices

__all__ = ["PLAN_FIELDS", "PlanFingerprint", "describe_plan_field", "fingerprint", "plan_fingerprint", "shard_checksum"]


def fingerprint(*parts: bytes) -> int:
    """A 62-bit hash of ``parts`` (fits an int64 tensor on every collective backend)."""
    digest = hashlib.blake2b(b"".join(parts), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


#: What a rank's plan is made of, in the order the rank agreement exchanges it. The first five are the
#: requests themselves (small ints: an index into the config's choices, the tolerance's float64 bits),
#: so that a mismatch can be quoted with each rank's value; the rest are hashes of derived facts.
PLAN_FIELDS: tuple[str, ...] = ("cp_size", "placement", "balance_tolerance", "kv_exchange", "backend",
                                "sliding_windows", "placement_rows", "exchange_strategies", "ulysses_size", "layout")


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
                     layout: bytes | None = None) -> PlanFingerprint:
    """The fingerprint of what every CP rank must have planned alike.

    Args:
        config: the context's config (backend and ``kv_exchange`` requests, ``balance_tolerance``).
        cp_size: the context's CP size.
        placement_kind / placement_rows: the placement used and its ``[P, L]`` position table.
        windows / strategies: the planned sliding windows and each exchange's resolved strategy.
        ulysses_size / layout: the step's head-parallel size ``u`` and, when ``u > 1``, the bytes of its
            :meth:`~hf_blockdiag_cp.planning.layout.LayoutPlan.key` (``None``: 0, today's layout).
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
        "placement_rows": fingerprint(placement_rows.to(torch.int64).contiguous().numpy().tobytes()),
        "exchange_strategies": fingerprint(repr(tuple(strategies)).encode()),
        "ulysses_size": ulysses_size,
        "layout": 0 if layout is None else fingerprint(layout),
    })


def describe_plan_field(name: str, value: int) -> str:
    """``value`` of plan field ``name`` as a user would write it (hashes are quoted as such)."""
    if name in ("cp_size", "ulysses_size"):
        return str(value)
    choices = {"placement": PLACEMENTS, "kv_exchange": KV_EXCHANGES, "backend": backend_choices()}.get(name)
    if choices is not None:
        return repr(choices[value]) if 0 <= value < len(choices) else f"another (hash {value:#x})"
    if name == "balance_tolerance":
        if value == -1:
            return "n/a (placement not balanced)"
        return f"{struct.unpack('<d', struct.pack('<q', value))[0]:g}"
    return f"hash {value:#x}"


#: Keeps a checksum non-negative (``-1`` means "not known" in the forward agreement).
_CHECKSUM_MASK = (1 << 62) - 1


def shard_checksum(values: torch.Tensor) -> torch.Tensor:
    """A position-weighted int64 checksum of an integer tensor, computed where ``values`` lives.

    The collator's host copy of a rank's shard and the tensor a forward actually receives (on its device)
    give the same value, so ranks can compare them without a host read of the batch. It is a checksum
    against edits and mix-ups, not a hash: ``sum((v + 1) * (i % 251 + 1)) * 1000003 + numel`` over the
    flattened tensor (``[B, L]`` rows in order), wrapped to 62 bits. Returns a 0-d int64 tensor.
    """
    flat = values.reshape(-1).to(torch.int64)
    weights = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64).remainder_(251).add_(1)
    total = ((flat + 1) * weights).sum() * 1000003 + flat.numel()
    return total.bitwise_and(_CHECKSUM_MASK)
