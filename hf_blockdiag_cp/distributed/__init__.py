"""Collectives of a CP group: the differentiable K/V exchanges, the per-step rank agreement, and
process groups that survive pickling. Planning lives in :mod:`hf_blockdiag_cp.planning`, the
per-layer CP path in :mod:`hf_blockdiag_cp.attention.cp`."""

from .agreement import AgreementError, agree_on_backends
from .exchange import CollectiveError, CommStats, RankExchange, exchange_kv
from .groups import GroupRef, group_options, group_timeout, group_to_ref, ref_to_group

__all__ = [
    "AgreementError",
    "CollectiveError",
    "CommStats",
    "GroupRef",
    "RankExchange",
    "agree_on_backends",
    "exchange_kv",
    "group_options",
    "group_timeout",
    "group_to_ref",
    "ref_to_group",
]
