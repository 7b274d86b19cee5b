"""The step's rank agreement before a recurrent layer's first collective (CP > 1).

The attention layers agree once per step (:func:`~hf_blockdiag_cp.attention.layer.step_backend`) before their first
K/V exchange; a hybrid model's first layer is often a recurrent one, whose state passing (an all-gather) or
head-parallel fallback (an all-to-all) must not start on ranks that planned differently (another placement,
``recurrent_layout`` or row). The same agreement (:func:`~hf_blockdiag_cp.distributed.agree_on_backends`: data and
plan fingerprints, positions in the group) runs here with no backends to choose, once per step, unless an attention
layer of the step already ran it. Every rank runs the same layers in the same order, so all take the same branch.
"""

from __future__ import annotations

import datetime

import torch

from ..attention.layer import require_live_group
from ..distributed import agree_on_backends
from ..runtime import step_runtime

__all__ = ["agree_recurrent"]


def agree_recurrent(ctx, device: torch.device) -> None:
    """Run the step's agreement once before the first recurrent collective of ``ctx``'s step (``cp_size > 1``);
    raises :class:`~hf_blockdiag_cp.errors.AgreementError` on every rank alike when the ranks' plans differ."""
    runtime = step_runtime(ctx)
    if runtime.agreed_backends is not None or runtime.recurrent.get("agreed"):
        return
    require_live_group(ctx, ctx.group, "CP")
    agree_on_backends(frozenset(), (), data_fingerprint=ctx.data_fingerprint, plan_fingerprint=ctx.plan_fingerprint,
                      group=ctx.group, rank=ctx.cp_rank, size=ctx.cp_size,
                      timeout=datetime.timedelta(seconds=ctx.config.collective_timeout_s), device=device)
    runtime.recurrent["agreed"] = True
