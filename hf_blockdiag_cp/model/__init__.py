"""Model preparation: what this package installs on a model, and what it decides from the model's structure.

:func:`prepare_model` owns the probe and the one ordered pair of forward hooks (:mod:`.prepare`);
:mod:`.detect` finds what a model cannot do with packed rows; :mod:`.batch` reads (and fills) a batch's
arguments; :mod:`.transformers_patches` holds every patch of transformers the package makes.
"""

from .batch import check_batch, check_cp_batch, context_position_ids
from .detect import UnsupportedModel, packing_refusal, refuse_bypassing_model, require_blockdiag_cp, uses_blockdiag_cp
from .prepare import ForwardProbe, mark_attention_call, package_hooks, prepare_model, unprepare_model
from .transformers_patches import patch_transformers

__all__ = [
    "ForwardProbe",
    "UnsupportedModel",
    "check_batch",
    "check_cp_batch",
    "context_position_ids",
    "mark_attention_call",
    "package_hooks",
    "packing_refusal",
    "patch_transformers",
    "prepare_model",
    "refuse_bypassing_model",
    "require_blockdiag_cp",
    "unprepare_model",
    "uses_blockdiag_cp",
]
