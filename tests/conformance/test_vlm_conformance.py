"""Issue 32: the conformance check of image-text-to-text architectures (:mod:`hf_blockdiag_cp.conformance.vlm_runs`).

docs/models.md's VLM section says what a fresh check says (two types re-run at CP = 1: one exact, one refused), it has
a row for every image-text-to-text type of the installed transformers (those without a fixture "not checked"), a wrong
layer is reported as FAIL with its numbers, and a refusal keeps the package's message. The CP = 2 cases run in the
slow test (spawned gloo ranks)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from hf_blockdiag_cp import integration
from hf_blockdiag_cp.conformance import cli
from hf_blockdiag_cp.conformance.multimodal import VLM_TYPES
from hf_blockdiag_cp.conformance.result import EXACT, FAIL, REFUSED, CheckResult
from hf_blockdiag_cp.conformance.sweep import read_jsonl
from hf_blockdiag_cp.conformance.vlm_report import (
    VLM_BEGIN,
    VLM_END,
    read_vlm_table,
    replace_vlm_section,
    vlm_section,
)
from hf_blockdiag_cp.conformance.vlm_runs import (
    NO_FIXTURE,
    NOT_CHECKED,
    VlmVerdict,
    check_vlm,
    not_checked,
    vlm_types,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "models.md"
#: Re-run at CP = 1 against the docs: gemma3 has an exact case (images) and a refused one (text-only rows).
FRESH = ("gemma3",)


@pytest.mark.parametrize("model_type", FRESH)
def test_vlm_section_agrees_with_a_fresh_check(model_type):
    """The section's CP = 1 cells (text-only, images) are the verdicts a fresh check gives; a refusal's cause is in
    the row's detail. Regenerate with ``python -m hf_blockdiag_cp.check --all --vlm-only --markdown docs/models.md``."""
    cells, detail = read_vlm_table(DOCS)[model_type]
    fresh = check_vlm(model_type, cp_size=1)
    assert [(v.images, v.cp_size) for v in fresh] == [(False, 1), (True, 1)]
    assert tuple(v.status for v in fresh) == cells[:2], (cells, [v.line() for v in fresh])
    for v in fresh:
        assert v.status in (EXACT, REFUSED), v.line()
        if v.status == REFUSED:
            assert v.reason[:120] in detail, (v.reason, detail)


def test_every_image_text_to_text_type_has_a_row():
    rows = read_vlm_table(DOCS)
    assert set(rows) == set(vlm_types()), set(rows) ^ set(vlm_types())
    for model, (cells, detail) in rows.items():
        assert len(cells) == 4, (model, cells)
        if model in VLM_TYPES:
            assert NOT_CHECKED not in cells and FAIL not in cells, (model, cells, detail)
        else:  # nothing claimed
            assert cells == (NOT_CHECKED,) * 4 and detail == NO_FIXTURE, (model, cells, detail)


def _on_layer_zero(monkeypatch, change):
    """Make the package's attention apply ``change`` to its output on the text model's layer 0 only."""
    layer = {}
    mark = integration.attention_context

    def marked(module, cp_context):
        layer["idx"] = getattr(module, "layer_idx", None)
        return mark(module, cp_context)

    def changed(strategy):
        def run(*args, **kwargs):
            out = strategy(*args, **kwargs)
            return change(out) if layer.get("idx") == 0 else out
        return run

    monkeypatch.setattr(integration, "attention_context", marked)
    for name, strategy in list(integration.STRATEGIES.items()):
        monkeypatch.setitem(integration.STRATEGIES, name, changed(strategy))


def test_a_wrong_layer_is_a_fail_with_its_numbers(monkeypatch):
    _on_layer_zero(monkeypatch, lambda out: out * 1.05)
    verdicts = check_vlm("llava", cp_size=1)
    for v in verdicts:
        assert v.status == FAIL and v.logits_err > 1e-3 and v.grad_err > 1e-3, v.line()
        assert "logits" in v.reason and "largest:" in v.reason, v.reason
    section = vlm_section([*verdicts, *not_checked("aria", 1)], command="test")
    assert "| `llava` | FAIL | FAIL |" in section and "**Of 1 architectures" in section and "1 FAIL" in section


def test_a_refusal_keeps_its_cause(monkeypatch, capsys):
    cause = "llava: a cause the check must keep (test)"

    def refuse(out):
        raise NotImplementedError(cause)

    _on_layer_zero(monkeypatch, refuse)
    # The command line: JSON per verdict, exit status 3 (refused).
    assert cli.main(["llava", "--cp-size", "1", "--json"]) == 3
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    verdicts = [VlmVerdict(**d) for d in lines]
    assert [(v.images, v.status) for v in verdicts] == [(False, REFUSED), (True, REFUSED)]
    assert all(v.reason == f"NotImplementedError: {cause}" for v in verdicts), [v.line() for v in verdicts]
    section = vlm_section(verdicts, command="test")
    assert "| `llava` | refused | refused |" in section and cause in section


def test_types_without_a_fixture_are_not_checked(capsys):
    assert cli.main(["aria", "--json"]) == 4
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(d["images"], d["cp_size"], d["status"], d["reason"]) for d in lines] == [
        (False, 1, NOT_CHECKED, NO_FIXTURE), (True, 1, NOT_CHECKED, NO_FIXTURE),
        (False, 2, NOT_CHECKED, NO_FIXTURE), (True, 2, NOT_CHECKED, NO_FIXTURE)]
    assert cli.main(["llama", "--vlm-only"]) == 2  # not an image-text-to-text type: one line naming it
    assert "llama is not an image-text-to-text model type" in capsys.readouterr().err


def test_the_vlm_section_is_rewritten_alone(tmp_path):
    """``--vlm-only --markdown`` rewrites the section between its markers (appends it the first time) and leaves the
    causal-LM sections byte for byte; the sweep's JSON lines hold both kinds of result, each read by its own reader."""
    causal = CheckResult("llama", EXACT, logits_err=1e-7, grad_err=1e-7, generate="equal", transformers="9.9")
    verdicts = [*not_checked("aria"), *not_checked("blip")]
    verdicts[0].status, verdicts[0].reason = REFUSED, "x | y"
    jsonl = tmp_path / "sweep.jsonl"
    jsonl.write_text("".join(json.dumps(asdict(r)) + "\n" for r in (causal, *verdicts)))
    assert [r.model for r in read_jsonl(jsonl)[0]] == ["llama"]
    head = "# Architecture conformance\n\n## Every architecture\n\n| `llama` | exact |\n"
    md = tmp_path / "models.md"
    md.write_text(head)
    argv = ["--from-jsonl", "--jsonl", str(jsonl), "--vlm-only", "--markdown", str(md)]
    assert cli.main(argv) == 0
    text = md.read_text()
    assert text.startswith(head) and text.count(VLM_BEGIN) == 1 and text.rstrip().endswith(VLM_END)
    assert cli.main(argv) == 0 and md.read_text() == text  # rewriting is idempotent
    rows = read_vlm_table(md)
    assert rows["aria"] == ((REFUSED,) + (NOT_CHECKED,) * 3, "text-only, CP = 1: x | y")
    assert rows["blip"] == ((NOT_CHECKED,) * 4, NO_FIXTURE)
    tail = "\n## After\n\nkept\n"
    md.write_text(text.replace(VLM_END + "\n", VLM_END + "\n" + tail))
    assert replace_vlm_section(md.read_text(), vlm_section(verdicts, command="c")).endswith(tail)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3"])
def test_cp2_cases_agree_with_the_docs(model_type):
    cells, _ = read_vlm_table(DOCS)[model_type]
    verdicts = check_vlm(model_type, cp_size=2)
    assert tuple(v.status for v in verdicts) == cells, [v.line() for v in verdicts]
    assert all("cut between the ranks" in v.layout for v in verdicts if v.cp_size == 2), [v.layout for v in verdicts]
    assert torch.isfinite(torch.tensor([v.grad_err for v in verdicts if v.grad_err is not None])).all()
