"""Conformance check: does ``attn_implementation="blockdiag_cp"`` compute exactly what an architecture asks for?

``python -m hf_blockdiag_cp.check MODEL_TYPE_OR_PATH [--cp-size N]`` (also ``hf-blockdiag-cp-check``) builds a
tiny random model of that architecture (a ``model_type`` of transformers' causal-LM mapping, or a local
``config.json`` / model folder, shrunk to a tiny size) and compares packed documents under ``"blockdiag_cp"``
with each document run alone under the model's stock attention:

- logits (max abs difference) and parameter gradients of the summed next-token loss (relative difference of
  all gradients together), for packed ``position_ids``, for ``DataCollatorWithFlattening``-style
  ``cu_seq_lens_*`` keywords and for :class:`~hf_blockdiag_cp.PackingCollator` batches (``cp_context``); with
  ``--cp-size N`` the collator path runs on ``N`` gloo ranks;
- ``generate()`` (greedy, left-padded batch) token for token against stock attention.

It prints ``exact``, ``refused (why)`` (the package raised ``NotImplementedError`` naming the cause), ``FAIL``
(different numbers, or another error) or ``n/a`` (a composite/multimodal wrapper, or the stock model itself
fails). ``--all`` sweeps every causal LM of the installed transformers, one subprocess per architecture, and
writes docs/models.md (``--markdown``) and the README's summary (``--readme``) from the same results.

Image-text-to-text types (``python -m hf_blockdiag_cp.check qwen2_5_vl``; ``--vlm-only`` for gemma3 / qwen3_5, which
are causal LMs too) get four verdicts: text-only packed rows and rows with images, at CP = 1 and on ``--cp-size`` ranks
(default 2), against each document alone (logits, loss, every gradient incl. the vision tower's); types without a
synthetic-document fixture are "not checked". ``--all`` writes them as docs/models.md's own section.

Modules, one job each: :mod:`.configs` (tiny configs), :mod:`.runs` (models, documents, the reference and the
packed runs), :mod:`.launch` (the CP run on gloo ranks), :mod:`.compare` (one architecture's verdict),
:mod:`.result` (the verdict record), :mod:`.sweep` (subprocess sweep), :mod:`.report` (Markdown, README),
:mod:`.multimodal` (VLM fixtures and reference), :mod:`.vlm_runs` (VLM verdicts and their sweep), :mod:`.vlm_report`
(their docs section), :mod:`.cli` (the command line). This subpackage is tooling: the runtime never imports it.
"""

from __future__ import annotations

from .cli import main, usage_error
from .compare import check_generate, check_model
from .configs import CHUNK_SIZE, CONFIG_FIXES, SLIDING_WINDOW, VOCAB, causal_lm_types, shrink_overrides, tiny_config
from .launch import run_cp
from .report import (
    REFUSAL_CAUSES,
    markdown_table,
    read_models_table,
    readme_summary,
    refusal_cause,
    replace_readme_summary,
)
from .result import (
    EXACT,
    FAIL,
    GRAD_RTOL,
    LOGITS_ATOL,
    NOT_APPLICABLE,
    REFUSED,
    CheckResult,
    describe_error,
    is_refusal,
    shorten,
)
from .runs import LENGTHS, VARIANTS, build_model, make_documents, packed_inputs, packed_run, reference_run
from .sweep import cp2_sample, read_jsonl, run_batch, run_isolated, sweep
from .vlm_report import read_vlm_table, vlm_section
from .vlm_runs import VlmVerdict, check_vlm, vlm_sweep, vlm_types

__all__ = [
    "CHUNK_SIZE",
    "CONFIG_FIXES",
    "EXACT",
    "FAIL",
    "GRAD_RTOL",
    "LENGTHS",
    "LOGITS_ATOL",
    "NOT_APPLICABLE",
    "REFUSAL_CAUSES",
    "REFUSED",
    "SLIDING_WINDOW",
    "VARIANTS",
    "VOCAB",
    "CheckResult",
    "VlmVerdict",
    "build_model",
    "causal_lm_types",
    "check_generate",
    "check_model",
    "check_vlm",
    "cp2_sample",
    "describe_error",
    "is_refusal",
    "main",
    "make_documents",
    "markdown_table",
    "packed_inputs",
    "packed_run",
    "read_jsonl",
    "read_models_table",
    "read_vlm_table",
    "readme_summary",
    "reference_run",
    "refusal_cause",
    "replace_readme_summary",
    "run_cp",
    "run_batch",
    "run_isolated",
    "shorten",
    "shrink_overrides",
    "sweep",
    "tiny_config",
    "usage_error",
    "vlm_section",
    "vlm_sweep",
    "vlm_types",
]
