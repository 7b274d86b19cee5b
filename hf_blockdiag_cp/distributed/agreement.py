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
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import AgreementError
from ..planning.fingerprint import PLAN_FIELDS, describe_plan_field
from .exchange import CollectiveError, all_gather_single, check_usable, wait

__all__ = ["AgreementError", "agree_on_backends", "agree_on_values"]


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
    _check_topology([r[3] for r in rows], [r[4] for r in rows], group_size)
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


def _check_topology(ranks: list[int], sizes: list[int], group_size: int) -> None:
    """Every rank's context must say where it sits in the group."""
    if sizes != [group_size] * group_size or ranks != list(range(group_size)):
        raise AgreementError(
            f"the CP group has {group_size} ranks, but the contexts of its ranks say cp_size={sizes}, "
            f"cp_rank={ranks}; build the collator / context with group=mesh['cp'] (or cp_size={group_size} "
            "and each rank's own cp_rank)")


#: The plan fields users set (the rest are derived from them and the data).
_REQUESTS = frozenset((*PLAN_FIELDS[:5], "ulysses_size", "ulysses_groups", "recurrent_layout"))


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
    if any(name == "ulysses_groups" for name, _ in differing):
        return (f"CP ranks hold different head-parallel subgroups ({'; '.join(parts)}): the ulysses_groups given to "
                "their contexts come from different hf_blockdiag_cp.ulysses_groups(...) calls (subgroups created "
                "twice), so their all-to-alls would run on different communicators and wait for each other until "
                "the timeout; create the subgroups once at setup and give every rank's collator/context those")
    return (f"CP ranks planned different K/V exchanges this step: their contexts differ in {'; '.join(parts)}; every "
            "rank of a CP group must build its context with the same BlockDiagCPConfig (HF_BLOCKDIAG_CP_* environment "
            "variables included), placement (a hybrid model's follows the collator's model_config) and sliding windows")


# ---- agreement on named integers (the model's per-forward agreement builds on it) --------------------------


def agree_on_values(values: dict[str, int], checksums: Sequence[torch.Tensor | int], expected: Sequence[int], *,
                    causes: dict[str, str], checked: dict[str, str], describe: Callable[[str, int], str],
                    what: str, subject: str, on_timeout: str, tag: int, group, rank: int, size: int,
                    timeout: datetime.timedelta, device: torch.device) -> None:
    """One small collective in which every rank of ``group`` sends named integers and checksums; raises
    :class:`AgreementError` on every rank alike when they differ.

    Args:
        values: this rank's value per name of ``causes`` (ints).
        checksums: per name of ``checked``, the checksum of what this rank holds (a 0-d int64 tensor on its
            device, computed there, or ``-1``: not given).
        expected: per name of ``checked``, what this rank expects to hold (``-1``: unknown).
        causes: every name, in the order the row carries it, with the likely cause of a difference.
        checked: the checksummed names, in row order, each with a hint for a mismatch (may be empty).
        describe: a value as the message shows it.
        what: the collective's name in errors; subject: what the ranks agree about ("this forward");
        on_timeout: the likely cause when a peer never joins (it ran a different sequence of calls).
        tag: first entry of every row (a row without it was paired with another collective).
        group / rank / size / timeout / device: as for :func:`agree_on_backends`.

    Each rank sends its own checksums with its own expectation, so every rank applies the same rule to the same
    table. On gloo the row (checksums included) is read to the host before sending; on NCCL the row goes to
    ``device`` and the table comes back once per call.
    """
    check_usable(group, what, rank)
    on_cpu = dist.get_backend(group) != "nccl"
    where = torch.device("cpu") if on_cpu else device
    host = torch.tensor([tag, rank, size, *(values[name] for name in causes), *expected], dtype=torch.int64)
    sums = [torch.as_tensor(c, dtype=torch.int64).reshape(1).to(where) for c in checksums]
    row = torch.cat([host.to(where), *sums])  # [tag, rank, size, values..., expected..., checksums...]
    width = row.numel()
    group_size = dist.get_world_size(group)
    table = row.new_empty(group_size * width)
    work = all_gather_single(table, row, group=group, async_op=True)
    try:
        wait(work, what, rank, timeout, group=group)
    except CollectiveError as err:  # a peer inside another collective (e.g. its backward) ran fewer calls
        raise CollectiveError(f"{err} — if no peer failed, {on_timeout}") from err
    rows = (table if on_cpu else table.cpu()).view(group_size, width).tolist()  # once per call
    strangers = [r for r, row_values in enumerate(rows) if row_values[0] != tag]
    if strangers:
        raise AgreementError(
            f"CP rank {rank}: the {what.removeprefix('blockdiag_cp ')} received another collective's message from "
            f"rank(s) {strangers}: the ranks' collectives are out of order; {on_timeout}")
    _check_topology([r[1] for r in rows], [r[2] for r in rows], group_size)
    problems = []
    for i, name in enumerate(causes, start=3):
        column = [r[i] for r in rows]
        if len(set(column)) > 1:
            quoted = ", ".join(f"rank {r}: {describe(name, v)}" for r, v in enumerate(column))
            problems.append(f"{name} ({quoted}): {causes[name]}")
    base = 3 + len(causes)
    for j, (name, hint) in enumerate(checked.items()):
        pairs = [(r, row_values[base + len(checked) + j], row_values[base + j]) for r, row_values in enumerate(rows)]
        wrong = [f"rank {r} (checksum {got:#x}, its cp_context expects {want:#x})"
                 for r, got, want in pairs if min(got, want) >= 0 and got != want]
        if wrong:
            problems.append(f"{name} on {', '.join(wrong)}: {hint}")
    if problems:
        raise AgreementError(f"CP ranks disagree about {subject} (checked before any K/V moves): "
                             + "; ".join(problems))
