"""Per-step rank agreement: one small host collective before the first K/V exchange of a step.

Every CP rank contributes a row ``[fingerprint, plan, backends]``: a hash of the step's full-row
document ids (all CP ranks must hold the same row), a hash of the exchange geometry, and the
bitmask of backends it can run. One ``all_gather`` later every rank holds every row and applies the
same pure rule, so all ranks either raise the same error or choose the same backend — none can hang
in a collective the others skip, or silently compute something else.
"""

from __future__ import annotations

import datetime
import functools
import operator

import torch
import torch.distributed as dist

from ..config import BACKENDS
from ..kernels import KernelSpec, available_backends
from .exchange import all_gather_single, wait

__all__ = ["AgreementError", "agree_on_backends"]

_NAMES = tuple(name for name in BACKENDS if name != "auto")


class AgreementError(RuntimeError):
    """CP ranks disagree about the step (different data or plans); raised on every rank alike."""


def _mask(names: frozenset[str]) -> int:
    return sum(1 << i for i, name in enumerate(_NAMES) if name in names)


def _names(mask: int) -> frozenset[str]:
    return frozenset(name for i, name in enumerate(_NAMES) if mask >> i & 1)


def agree_on_backends(spec: KernelSpec, *, data_fingerprint: int, plan_fingerprint: int,
                      disabled: tuple[str, ...], group, rank: int, timeout: datetime.timedelta,
                      device: torch.device) -> frozenset[str]:
    """Backends every rank of ``group`` can run for ``spec``; raises :class:`AgreementError` on all
    ranks if their data or plans differ.

    The collective runs on the CPU when the group's backend supports it (gloo): no device sync.
    On an NCCL-only group it runs on ``device`` and reads the result back once per step.
    """
    local = available_backends(spec, disabled)
    row = torch.tensor([data_fingerprint, plan_fingerprint, _mask(local)], dtype=torch.int64)
    size = dist.get_world_size(group)
    on_cpu = dist.get_backend(group) != "nccl"
    row_dev = row if on_cpu else row.to(device)
    table = row_dev.new_empty(size * 3)
    work = all_gather_single(table, row_dev, group=group, async_op=True)
    wait(work, "blockdiag_cp rank agreement", rank, timeout)
    rows = (table if on_cpu else table.cpu()).view(size, 3).tolist()  # once per step, on the host
    data = [r[0] for r in rows]
    plans = [r[1] for r in rows]
    if len(set(data)) != 1:
        raise AgreementError(
            "CP ranks hold different packed rows this step (document-id fingerprints "
            f"{data}); every rank of a CP group must get the same documents — shard the data over the "
            "data-parallel dimension only (see hf_blockdiag_cp.init_device_mesh)")
    if len(set(plans)) != 1:
        raise AgreementError(f"CP ranks planned different K/V exchanges this step (fingerprints {plans}); "
                             "check that every rank uses the same BlockDiagCPConfig (kv_exchange, cp_size)")
    return _names(functools.reduce(operator.and_, (r[2] for r in rows)))
