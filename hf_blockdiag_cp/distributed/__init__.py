"""Collectives of a CP group: the differentiable K/V exchanges, a named all-gather of fixed-shape buffers, the per-step
rank agreement, and
process groups that survive pickling. :mod:`.exchange` owns the record of CP groups broken by a
failed collective (``mark_broken`` / ``check_usable``). Planning lives in :mod:`hf_blockdiag_cp.planning`, the
per-layer CP path in :mod:`hf_blockdiag_cp.attention.layer`."""

from .agreement import AgreementError, agree_on_backends
from .exchange import (
    CollectiveError,
    CommStats,
    ExchangeSizeError,
    GatherGroup,
    RankExchange,
    all_gather,
    check_message,
    check_usable,
    exchange_kv,
    mark_broken,
)
from .groups import GroupRef, group_options, group_timeout, group_to_ref, ref_to_group

__all__ = [
    "AgreementError",
    "CollectiveError",
    "CommStats",
    "ExchangeSizeError",
    "GatherGroup",
    "GroupRef",
    "RankExchange",
    "agree_on_backends",
    "all_gather",
    "check_message",
    "check_usable",
    "exchange_kv",
    "group_options",
    "group_timeout",
    "group_to_ref",
    "mark_broken",
    "ref_to_group",
]
