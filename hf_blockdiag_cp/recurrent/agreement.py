"""The step's rank agreement before a recurrent layer's first collective (CP > 1).

The attention layers agree once per step (:func:`~hf_blockdiag_cp.attention.layer.step_backend`) before their first
K/V exchange; a hybrid model's first layer is often a recurrent one, whose state passing (an all-gather) or
head-parallel fallback (an all-to-all) must not start on ranks that planned differently (another placement,
``recurrent_layout`` or row). The same agreement (:func:`~hf_blockdiag_cp.distributed.agree_on_backends`: data and
plan fingerprints, positions in the group) runs here with no backends to choose, once per step, unless an attention
layer of the step already ran it. Every rank runs the same layers in the same order, so all take the same branch.
"""

from __future__ import annotations

import torch

from ..runtime import step_runtime

__all__ = ["agree_recurrent"]


def agree_recurrent(ctx, device: torch.device) -> None:
    """Run the step's agreement once before the first recurrent collective of ``ctx``'s step (``cp_size > 1``);
    raises :class:`~hf_blockdiag_cp.errors.AgreementError` on every rank alike when the ranks' plans differ.
    The step runtime's one agreement (:meth:`~hf_blockdiag_cp.runtime.StepRuntime.agree`), shared with attention."""
    step_runtime(ctx).agree(ctx, device)
