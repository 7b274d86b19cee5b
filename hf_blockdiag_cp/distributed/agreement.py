"""Per-step rank agreement: one small host collective before the first K/V exchange of a step.

Every CP rank contributes a row ``[data, plan, backends, cp_rank, cp_size]``: a hash of the step's
full rows (document ids and tokens; all CP ranks must hold the same row), a hash of the exchange
geometry, the bitmask of backends it can run, and where its context says it sits in the group.
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

from .exchange import all_gather_single, wait

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
        data_fingerprint / plan_fingerprint: this rank's hashes of the step's rows and exchange plan.
        group: the CP process group; ``rank`` / ``size`` are what this rank's context says.
        timeout: bound on the collective.
        device: where the collective runs when the group's backend has no CPU path (NCCL).

    The collective runs on the CPU when the group's backend supports it (gloo): no device sync.
    On an NCCL-only group it runs on ``device`` and reads the result back once per step.
    """
    row = torch.tensor([data_fingerprint, plan_fingerprint, _mask(local, universe), rank, size], dtype=torch.int64)
    width = row.numel()
    group_size = dist.get_world_size(group)
    on_cpu = dist.get_backend(group) != "nccl"
    row_dev = row if on_cpu else row.to(device)
    table = row_dev.new_empty(group_size * width)
    work = all_gather_single(table, row_dev, group=group, async_op=True)
    wait(work, "blockdiag_cp rank agreement", rank, timeout)
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
        raise AgreementError(f"CP ranks planned different K/V exchanges this step (fingerprints {plans}); "
                             "check that every rank uses the same BlockDiagCPConfig (kv_exchange, cp_size)")
    return _names(functools.reduce(operator.and_, (r[2] for r in rows)), universe)
