"""Model preparation: what this package installs on a model, and what it decides from the model's structure.

:func:`prepare_model` owns the findings, the forward state and the one ordered pair of forward hooks (:mod:`.prepare`);
:mod:`.detect` finds what a model cannot do with packed rows; :mod:`.batch` reads (and fills) a batch's
arguments. The patches of transformers that call :func:`prepare_model` live in :mod:`hf_blockdiag_cp.integration`.
"""

from .batch import check_batch, check_cp_batch, context_position_ids
from .detect import UnsupportedModel, packing_refusal, refuse_bypassing_model, require_blockdiag_cp, uses_blockdiag_cp
from .prepare import ForwardState, ModelFindings, attention_context, package_hooks, prepare_model, unprepare_model

__all__ = [
    "ForwardState",
    "ModelFindings",
    "UnsupportedModel",
    "check_batch",
    "check_cp_batch",
    "context_position_ids",
    "attention_context",
    "package_hooks",
    "packing_refusal",
    "prepare_model",
    "refuse_bypassing_model",
    "require_blockdiag_cp",
    "unprepare_model",
    "uses_blockdiag_cp",
]
