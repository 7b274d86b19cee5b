"""The sweep as documentation: docs/models.md (counts, refusal causes, the CP = 2 sample, one row per
architecture) and the summary block of the README, both written from the same results so they cannot
disagree, plus :func:`read_models_table`, which reads the rows back (the docs test compares them with a
fresh check)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers

from .configs import CHUNK_SIZE, SLIDING_WINDOW
from .result import EXACT, FAIL, GRAD_RTOL, LOGITS_ATOL, NOT_APPLICABLE, REFUSED, STATUSES, CheckResult, shorten
from .runs import LENGTHS

__all__ = [
    "DETAIL_LIMIT",
    "README_BEGIN",
    "README_END",
    "REFUSAL_CAUSES",
    "markdown_table",
    "read_models_table",
    "readme_summary",
    "refusal_cause",
    "replace_readme_summary",
]

#: Refusal causes by a phrase of their message (first match wins), for the summary of the table.
REFUSAL_CAUSES: tuple[tuple[str, str], ...] = (
    ("does not route attention through", "attention computed outside `AttentionInterface` (refused when the model "
                                         "is loaded)"),
    ("carry state across the whole row", "other token mixers (state-space / linear-attention scans, sequence "
                                         "convolutions, recurrent cells): packed rows with more than one document "
                                         "and CP shards refused"),
    ("forward takes no position_ids", "position embeddings counted from the row start: packed rows refused"),
    ("padding_idx + 1", "positions offset by `padding_idx + 1` (RoBERTa family): packed rows refused"),
    ("reads the attention mask itself", "model code uses the attention mask itself (indexers, additive masks)"),
    ("s_aux", "attention sinks (`s_aux`) in a form blockdiag_cp does not implement"),
    ("softcap", "logit softcapping in a form blockdiag_cp does not implement"),
    ("bidirectional", "bidirectional (encoder) attention"),
    ("not causal", "non-causal attention layers (e.g. cross-attention of a composite sub-model)"),
    ("to its attention function", "an attention keyword blockdiag_cp does not implement"),
    ("mask", "a mask pattern blockdiag_cp does not implement"),
)
#: Characters of a reason shown in a table cell (cut between words).
DETAIL_LIMIT = 400
README_BEGIN = "<!-- conformance summary: begin (written by hf_blockdiag_cp.check --readme; do not edit by hand) -->"
README_END = "<!-- conformance summary: end -->"


def refusal_cause(reason: str) -> str:
    """The :data:`REFUSAL_CAUSES` entry a refusal message belongs to (``other`` if none)."""
    return next((cause for phrase, cause in REFUSAL_CAUSES if phrase in reason), "other")


def _counts(results: Sequence[CheckResult]) -> dict[str, int]:
    return {s: sum(r.status == s for r in results) for s in STATUSES}


def _versions(results: Sequence[CheckResult]) -> str:
    """The transformers version the results were checked with (the installed one when it checked any), and
    how many rows another version checked (rows carried over from an older sweep say so)."""
    by_version: dict[str, int] = {}
    for r in results:
        version = r.transformers or transformers.__version__
        by_version[version] = by_version.get(version, 0) + 1
    main = transformers.__version__ if transformers.__version__ in by_version else max(by_version, key=by_version.get)
    others = [f"{n} of {len(results)} rows carried over from a sweep with transformers {v}, not re-run"
              for v, n in sorted(by_version.items()) if v != main]
    return main + (f" ({'; '.join(others)})" if others else "")


def _by_cause(results: Sequence[CheckResult]) -> list[tuple[str, list[str]]]:
    by_cause: dict[str, list[str]] = {}
    for r in results:
        if r.status == REFUSED:
            by_cause.setdefault(refusal_cause(r.reason), []).append(r.model)
    return sorted(by_cause.items(), key=lambda kv: -len(kv[1]))


def _cell(text: str, limit: int = DETAIL_LIMIT) -> str:
    return shorten(text, limit).replace("|", "\\|")


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.0e}"


#: What the page says about what a model computes besides attention (heads, losses): not per architecture.
BEYOND_ATTENTION = (
    "What is exact besides attention (for every architecture above):",
    "",
    "- *MoE router auxiliary loss* (`output_router_logits=True`): exact under CP for every causal LM whose loss "
    "transformers adds with the Switch-style `load_balancing_loss_func` (mixtral, qwen2_moe, qwen3_moe, olmoe, "
    "granitemoe(shared), phimoe, jetmoe, flex_olmo, ernie4_5_moe, gpt_oss, ...): the row's router logits are gathered "
    "over the CP group, the model's own function runs on them, and each rank counts `1 / P` of it, so the losses "
    "summed over the ranks and their gradients equal one process on the row (`tests/distributed/test_moe_aux_loss.py`, "
    "CP = 2 and 4, and in `CPTrainer`). Another router loss returned under CP is refused. The chunked loss refuses "
    "`output_router_logits` (it would drop the term); `CPTrainer` then uses the model's own loss.",
    "- *Classification heads*: `*ForTokenClassification` is per token and exact. Row-pooling heads "
    "(`*ForSequenceClassification` — reward models —, `*ForQuestionAnswering`, `*ForMultipleChoice`) give one answer "
    "per row: refused on packed rows (also at CP = 1) and CP shards; one document per row without CP is the stock "
    "computation.",
    "- *`logits_to_keep=k`*: refused under CP (it would keep each shard's last positions); at CP = 1 a packed row's "
    "last `k` positions, as stock.",
    "- *A model that computes its own loss* (whisper's causal LM): its logits are exact, but a training batch's "
    "`labels` / `shift_labels` are refused (compute the loss from the logits); its detail cell says so.",
    '- *Sparse-indexer attention* (DeepSeek-V3.2 DSA `deepseek_v32`, GLM-MoE-DSA `glm_moe_dsa`, its `"shared"` '
    'layers included): each indexer is served per document (`hf_blockdiag_cp/sparse/`): a query is scored only '
    'against the keys of its own document at or before it, with a running top-k over key blocks (never an `[L, S]` '
    'score matrix), and attends over its selected keys (gather + softmax, memory `O(L · index_topk)` per head); a '
    'document no longer than `index_topk` selects every earlier key without scoring. **Tie rule**: keys are ranked '
    'by score, descending, and keys of equal score by their position *in the document*, ascending (the lower '
    'position first). The stock indexers call `torch.topk` over the whole row, whose choice among equal scores '
    'depends on the absolute index in the row; with tiny random weights many keys score exactly 0 (ReLU) and ties '
    'at the cut-off are common, so the stock model on a packed row differs from its documents alone (0.19 / 0.15 in'
    " logits, `tests/sparse/test_packed_cp1.py`). The package's rule depends on nothing but the document (not its "
    'place in the row, its neighbours, or later the CP split); with the same stable rule patched into the stock '
    "indexer's top-k, a packed row at CP = 1 equals each document alone (`cp_context`, `cu_seq_lens_*` and packed "
    '`position_ids`: logits, loss and gradients within 3e-7). Where scores are not tied the selection is the stock '
    'one. The conformance check above runs the default `index_topk` (2048: every key selected); CP > 1 is refused '
    'on every rank (the indexer keys and MLA latent exchange is not implemented yet), as are a cache with packed '
    'rows and a `cp_context` (`use_cache=False`).',
)


def markdown_table(results: Sequence[CheckResult], *, title: str, seconds: float | None,
                   cp2: Sequence[CheckResult] = (), command: str = "", cp2_ulysses: Sequence[CheckResult] = ()) -> str:
    """The sweep as Markdown: counts, refusal causes, the CP = 2 sample, then one row per architecture.
    ``seconds`` (the sweep's wall time) is accepted but not shown: the page states the checks' summed time."""
    counts = _counts(results)
    # The checks' own times, summed: a sweep resumed from its JSON lines has a wall time of its last part only.
    took = (f" ({sum(r.seconds for r in (*results, *cp2)) / 60:.0f} min of checks summed, on {os.cpu_count()} CPU "
            "cores; every check in a subprocess, so a crash or a hang cannot stop the sweep)")
    command = command or "python -m hf_blockdiag_cp.check --all --cp2-sample 12 --markdown docs/models.md"
    lines = [
        f"# {title}",
        "",
        f"Generated by `{command}` with transformers {_versions([*results, *cp2])}, "
        f"torch {torch.__version__.split('+')[0]} (CPU, fp32): {len(results)} architectures (every entry of "
        f"`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`){took}.",
        "",
        f"**{counts[EXACT]} exact, {counts[REFUSED]} refused, {counts[FAIL]} FAIL, {counts[NOT_APPLICABLE]} not "
        "applicable.**",
        "",
        "Each architecture is built from a tiny random config (hidden size 64, two layers covering every layer "
        f"type of the architecture, sliding windows of {SLIDING_WINDOW}, chunks of {CHUNK_SIZE}) and a row of "
        f"documents of {', '.join(map(str, LENGTHS))} tokens is compared with each document run alone under the "
        "model's stock attention:",
        "",
        "- *exact*: packed `position_ids`, `cu_seq_lens_*` keywords (as `DataCollatorWithFlattening` emits them) "
        f"and `PackingCollator` batches (`cp_context`) all give logits within {LOGITS_ATOL:g} and gradients within "
        f"{GRAD_RTOL:g} (relative) of the reference, and `generate()` (greedy, left-padded batch) gives the same "
        "tokens as stock attention.",
        "- *refused*: blockdiag_cp raises `NotImplementedError` naming the cause instead of computing something else "
        "(the cause is shown; most refusals concern packed rows only, and one document per row still works).",
        "- *FAIL*: different numbers or another error: a bug.",
        "- *n/a*: composite / multimodal wrappers whose text model is checked as its own entry, and architectures "
        "whose stock model cannot be built or run from a default config in this transformers version.",
        "",
        *BEYOND_ATTENTION,
        "",
        "Check your own model (a `model_type` or a local config / model folder, shrunk to a tiny size): "
        "`python -m hf_blockdiag_cp.check MODEL_TYPE_OR_PATH [--cp-size 2]`, also installed as "
        "`hf-blockdiag-cp-check`. This page and the summary in the README are written together by the sweep "
        "(`--markdown` and `--readme`); `tests/conformance/test_conformance.py` checks the rows of its fast "
        "list of architectures against the verdicts a fresh check gives them.",
        "",
    ]
    causes = _by_cause(results)
    if causes:
        lines += ["## Why architectures are refused", "", "| cause | architectures |", "|---|---|"]
        for cause, models in causes:
            lines.append(f"| {cause} | {len(models)}: " + ", ".join(f"`{m}`" for m in models) + " |")
        lines.append("")
    if cp2:
        one = {r.model: r.status for r in results}
        c2 = _counts(cp2)
        exact_one = {r.model for r in results if r.status == EXACT}
        which = ("every architecture exact at CP = 1, plus named ones" if exact_one <= {r.model for r in cp2}
                 else "a sample of the exact ones, plus named ones")
        lines += ["## Context parallelism", "",
                  f"At CP = 2 (two gloo ranks, `PackingCollator` batches with the K/V exchange), of {len(cp2)} "
                  f"architectures ({which}): **{c2[EXACT]} exact, {c2[REFUSED]} "
                  f"refused, {c2[FAIL]} FAIL, {c2[NOT_APPLICABLE]} not applicable.**", "",
                  "| model type | CP = 1 | CP = 2 | logits | grads | detail |", "|---|---|---|---|---|---|"]
        for r in cp2:
            lines.append(f"| `{r.model}` | {one.get(r.model, '')} | {r.status} | {_num(r.logits_err)} | "
                         f"{_num(r.grad_err)} | {_cell(r.reason)} |")
        lines.append("")
    if cp2_ulysses:
        one = {r.model: r.status for r in results}
        seq = {r.model: r.status for r in cp2}
        u = max(r.ulysses_size for r in cp2_ulysses)
        cu = _counts(cp2_ulysses)
        lines += [f"## Head-parallel layout (ulysses_size = {u})", "",
                  f"At CP = 2 with `ulysses_size={u}` (the collator's head-parallel layout: an all-to-all of the "
                  f"heads, head shape from `model_config`), of {len(cp2_ulysses)} architectures: **{cu[EXACT]} exact, "
                  f"{cu[REFUSED]} refused, {cu[FAIL]} FAIL, {cu[NOT_APPLICABLE]} not applicable.**", "",
                  f"| model type | CP = 1 | CP = 2 | CP = 2, u = {u} | logits | grads | detail |",
                  "|---|---|---|---|---|---|---|"]
        for r in cp2_ulysses:
            lines.append(f"| `{r.model}` | {one.get(r.model, '')} | {seq.get(r.model, 'not run')} | {r.status} | "
                         f"{_num(r.logits_err)} | {_num(r.grad_err)} | {_cell(r.reason)} |")
        lines.append("")
    at_cp2 = {r.model: r.status for r in cp2}
    lines += ["## Every architecture", "", "| model type | result | CP = 2 | logits | grads | generate | detail |",
              "|---|---|---|---|---|---|---|"]
    for r in results:
        gen = r.generate if len(r.generate) < 40 else r.generate.split(":")[0]
        lines.append(f"| `{r.model}` | {r.status} | {at_cp2.get(r.model, 'not run')} | {_num(r.logits_err)} | "
                     f"{_num(r.grad_err)} | {gen.replace('|', '/')} | {_cell(r.reason)} |")
    return "\n".join(lines) + "\n"


def readme_summary(results: Sequence[CheckResult], cp2: Sequence[CheckResult] = ()) -> str:
    """The README's summary of the sweep (the text between :data:`README_BEGIN` and :data:`README_END`)."""
    counts = _counts(results)
    text = (f"For transformers {_versions([*results, *cp2])} ([docs/models.md](docs/models.md)): "
            f"of {len(results)} causal LMs, "
            f"**{counts[EXACT]} exact, {counts[REFUSED]} refused with the cause, {counts[FAIL]} FAIL, "
            f"{counts[NOT_APPLICABLE]} not applicable** (composite / multimodal wrappers whose text model is its "
            "own entry, and architectures whose stock model cannot be built or run from a default config).")
    if cp2:
        c2 = _counts(cp2)
        text += (f" At CP = 2 (two gloo ranks), of {len(cp2)} architectures checked: {c2[EXACT]} exact, "
                 f"{c2[REFUSED]} refused, {c2[FAIL]} FAIL")
        odd = [f"`{r.model}`: {r.status}, "
               + (refusal_cause(r.reason) if r.status == REFUSED else shorten(r.reason, 160))
               for r in cp2 if r.status != EXACT]
        if odd:
            text += " (" + "; ".join(odd) + ")"
        text += "."
    causes = _by_cause(results)
    if causes:
        text += ("\n\nRefused, with the reason in the error: "
                 + "; ".join(f"{cause} ({len(models)})" for cause, models in causes) + ".")
    return text


def replace_readme_summary(readme: str, summary: str) -> str:
    """``readme`` with the text between its summary markers replaced by ``summary``."""
    begin, end = readme.find(README_BEGIN), readme.find(README_END)
    if begin < 0 or end < begin:
        raise ValueError(f"the README has no summary block: add the lines {README_BEGIN!r} and {README_END!r}")
    return readme[: begin + len(README_BEGIN)] + "\n" + summary.strip() + "\n" + readme[end:]


_CELL_SPLIT = re.compile(r"(?<!\\)\|")


def read_models_table(path: Path) -> dict[str, tuple[str, str]]:
    """``model type -> (result, detail)`` from the "Every architecture" table of a docs/models.md."""
    rows: dict[str, tuple[str, str]] = {}
    in_table = False
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            in_table = line.strip() == "## Every architecture"
            continue
        if in_table and line.startswith("| `"):
            cells = [c.strip() for c in _CELL_SPLIT.split(line.strip())[1:-1]]
            rows[cells[0].strip("`")] = (cells[1], cells[-1].replace("\\|", "|"))
    return rows
