"""Per-step rank agreement: one small host collective before the first K/V exchange of a step.

Every CP rank contributes a row ``[data, plan, backends, cp_rank, cp_size, plan fields...]``: a hash of
the step's full rows (document ids and tokens; all CP ranks must hold the same row), a hash of the
exchange geometry, the bitmask of backends it can run, where its context says it sits in the group,
and the fields the plan hash was made from (:data:`~hf_blockdiag_cp.planning.fingerprint.PLAN_FIELDS`:
placement, backend request, balance tolerance, ``kv_exchange``, ...), so that a mismatch names them.
One ``all_gather`` later every rank holds every row and applies the same pure rule, so all ranks
either raise the same error or choose the same backend — none can hang in a collective the others
skip, or silently compute something else.
"""

from __future__ import annotations

import datetime
import functools
import operator
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..planning.fingerprint import PLAN_FIELDS, describe_plan_field
from .exchange import all_gather_single, check_usable, wait

__all__ = ["AgreementError", "agree_on_backends"]


class AgreementError(RuntimeError):
    """CP ranks disagree about the step (different data, plans or topology); raised on every rank alike."""


def _mask(names: frozenset[str], universe: Sequence[str]) -> int:
    return sum(1 << i for i, name in enumerate(universe) if name in names)


def _names(mask: int, universe: Sequence[str]) -> frozenset[str]:
    return frozenset(name for i, name in enumerate(universe) if mask >> i & 1)


def agree_on_backends(local: frozenset[str], universe: Sequence[str], *, data_fingerprint: int,
                      plan_fingerprint: int, group, rank: int, size: int, timeout: datetime.timedelta,
                      device: torch.device) -> frozenset[str]:
    """Backends every rank of ``group`` can run; raises :class:`AgreementError` on all ranks if their
    data, plans or positions in the group differ.

    Args:
        local: the backends this process can run for the step's first kernel spec.
        universe: every backend name, in one order shared by all ranks (bit ``i`` = ``universe[i]``).
        data_fingerprint / plan_fingerprint: this rank's hashes of the step's rows and exchange plan (a
            :class:`~hf_blockdiag_cp.planning.fingerprint.PlanFingerprint` also carries its fields;
            a plain int compares as a whole).
        group: the CP process group; ``rank`` / ``size`` are what this rank's context says.
        timeout: bound on the collective.
        device: where the collective runs when the group's backend has no CPU path (NCCL).

    The collective runs on the CPU when the group's backend supports it (gloo): no device sync.
    On an NCCL-only group it runs on ``device`` and reads the result back once per step.
    """
    what = "blockdiag_cp rank agreement"
    check_usable(group, what, rank)
    fields = getattr(plan_fingerprint, "fields", {})
    row = torch.tensor([data_fingerprint, plan_fingerprint, _mask(local, universe), rank, size,
                        *(fields.get(name, 0) for name in PLAN_FIELDS)], dtype=torch.int64)
    width = row.numel()
    group_size = dist.get_world_size(group)
    on_cpu = dist.get_backend(group) != "nccl"
    row_dev = row if on_cpu else row.to(device)
    table = row_dev.new_empty(group_size * width)
    work = all_gather_single(table, row_dev, group=group, async_op=True)
    wait(work, what, rank, timeout, group=group)
    rows = (table if on_cpu else table.cpu()).view(group_size, width).tolist()  # once per step, on the host
    sizes = [r[4] for r in rows]
    ranks = [r[3] for r in rows]
    if sizes != [group_size] * group_size or ranks != list(range(group_size)):
        raise AgreementError(
            f"the CP group has {group_size} ranks, but the contexts of its ranks say cp_size={sizes}, "
            f"cp_rank={ranks}; build the collator / context with group=mesh['cp'] (or cp_size={group_size} "
            "and each rank's own cp_rank)")
    data = [r[0] for r in rows]
    if len(set(data)) != 1:
        raise AgreementError(
            "CP ranks hold different packed rows this step (fingerprints of document ids and tokens "
            f"{data}); every rank of a CP group must get the same documents — shard the data over the "
            "data-parallel dimension only (see hf_blockdiag_cp.init_device_mesh)")
    plans = [r[1] for r in rows]
    if len(set(plans)) != 1:
        raise AgreementError(_plan_mismatch(plans, [r[5:] for r in rows]))
    return _names(functools.reduce(operator.and_, (r[2] for r in rows)), universe)


#: The plan fields users set (the rest are derived from them and the data).
_REQUESTS = frozenset((*PLAN_FIELDS[:5], "ulysses_size"))


def _plan_mismatch(plans: list[int], fields: list[list[int]]) -> str:
    """The message for ranks whose plans differ: every differing field with each rank's value."""
    differing = [(name, [row[i] for row in fields]) for i, name in enumerate(PLAN_FIELDS)
                 if len({row[i] for row in fields}) > 1]
    requested = [(name, values) for name, values in differing if name in _REQUESTS]
    differing = requested or differing  # a different request explains the derived differences
    if any(name == "placement" for name, _ in differing):  # only a balanced placement has a tolerance
        differing = [(name, values) for name, values in differing if name != "balance_tolerance" or -1 not in values]
    if not differing:  # a rank without per-field fingerprints (a hand-made context): only the hashes
        return (f"CP ranks planned different K/V exchanges this step (fingerprints {plans}); check that every "
                "rank uses the same BlockDiagCPConfig (placement, balance_tolerance, kv_exchange, backend) and cp_size")
    parts = [f"{name} (" + ", ".join(f"rank {r}: {describe_plan_field(name, v)}" for r, v in enumerate(values)) + ")"
             for name, values in differing]
    return (f"CP ranks planned different K/V exchanges this step: their contexts differ in {'; '.join(parts)}; every "
            "rank of a CP group must build its context with the same BlockDiagCPConfig (HF_BLOCKDIAG_CP_* environment "
            "variables included), placement and sliding windows")
