"""Architecture conformance (issue 12): :mod:`hf_blockdiag_cp.conformance` on a fixed sample covering every class
of the full sweep, each expected exact (packed documents equal each document alone under stock
attention: logits, gradients, ``generate()``) or refused with a message naming the cause. The full
sweep over every causal LM of transformers and the CP = 2 sample are marked slow."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_blockdiag_cp import conformance
from hf_blockdiag_cp.conformance import EXACT, FAIL, REFUSED, check_model

#: model type -> (expected status, a phrase the refusal must contain). One or more per sweep class.
FAST = {
    # plain attention, learned absolute positions, windows
    "llama": (EXACT, ""),
    "gpt2": (EXACT, ""),
    "qwen2": (EXACT, ""),
    "mistral": (EXACT, ""),
    "gemma3_text": (EXACT, ""),
    "cohere2": (EXACT, ""),
    "gpt_neox": (EXACT, ""),
    # 1. models that do not pass position_ids to their layers
    "ctrl": (EXACT, ""),
    "gpt_bigcode": (EXACT, ""),
    "persimmon": (EXACT, ""),
    "whisper": (EXACT, ""),
    # 2. Llama 4 chunked attention
    "llama4_text": (EXACT, ""),
    # 3. model code reading the mask itself
    "doge": (REFUSED, "reads the attention mask itself"),
    "deepseek_v32": (EXACT, ""),  # its DSA indexer served per document (hf_blockdiag_cp/sparse)
    # 4. attention outside AttentionInterface
    "openai-gpt": (REFUSED, "does not route attention through transformers' AttentionInterface"),
    "xlnet": (REFUSED, "does not route attention through transformers' AttentionInterface"),
    # 5. other token mixers: served per document fragment since issue 24, except those not listed there
    "mamba": (EXACT, ""),
    "qwen3_next": (EXACT, ""),
    "lfm2": (EXACT, ""),
    "inkling2_text": (REFUSED, "has no per-document reset or state passing"),
    # 6. positions counted from the row start
    "bart": (REFUSED, "forward takes no position_ids"),
    "marian": (REFUSED, "forward takes no position_ids"),
    # 7. attention sinks / softcapping (exact: sdpa_doc implements both)
    "gpt_oss": (EXACT, ""),
    "gemma2": (EXACT, ""),
    # encoder families as decoders: BERT exact, RoBERTa's offset positions refused
    "bert": (EXACT, ""),
    "roberta": (REFUSED, "padding_idx + 1"),
    # 9. stale is_causal flag (packing refused for its learned positions; generate() must match)
    "bigbird_pegasus": (REFUSED, "forward takes no position_ids"),
}


DOCS = Path(__file__).resolve().parents[2] / "docs" / "models.md"
README = Path(__file__).resolve().parents[2] / "README.md"

GENERATE = {"llama", "gpt2", "qwen2", "llama4_text", "whisper", "ctrl", "bert"}


@pytest.mark.parametrize("model_type", list(FAST))
def test_fast_sweep(model_type):
    expected, phrase = FAST[model_type]
    # To stay fast: a refusal shows on the first packed variant; exact ones run packed position_ids and
    # PackingCollator batches, generate() for a subset (the slow full sweep runs everything everywhere).
    refused = expected == REFUSED
    result = check_model(model_type, generate=model_type in GENERATE,
                         variants=("position_ids",) if refused else ("position_ids", "collator"))
    assert result.status == expected, result.line() + "\n" + json.dumps(result.variants, indent=1)
    if expected == REFUSED:
        assert phrase in result.reason and model_type in result.reason, result.reason
    else:
        assert result.logits_err <= conformance.LOGITS_ATOL and result.grad_err <= conformance.GRAD_RTOL
        assert all(v.startswith("ok") for v in result.variants.values()), result.variants
        assert result.generate == ("equal" if model_type in GENERATE else "not run")
        # Issue 27: exact logits, but the row says what a training batch gets when the model's own loss refuses it.
        assert ("training batch's labels / shift_labels are refused" in result.reason) == (model_type == "whisper")


@pytest.mark.parametrize("model_type", list(FAST))
def test_models_md_agrees_with_the_fast_list(model_type):
    """docs/models.md's row says what a fresh check says (``test_fast_sweep`` holds the check to ``FAST``):
    the same verdict, and for a refusal the same cause. Regenerate the docs with the sweep if this fails."""
    rows = conformance.read_models_table(DOCS)
    expected, phrase = FAST[model_type]
    assert model_type in rows, f"docs/models.md has no row for {model_type}"
    status, detail = rows[model_type]
    assert status == expected, f"docs/models.md says {model_type} is {status}, the check says {expected}"
    if expected == REFUSED:
        assert phrase in detail, f"docs/models.md gives {model_type} another cause: {detail}"


def test_readme_summary_agrees_with_models_md():
    """The README's block holds the counts of docs/models.md's table (both are written by one sweep)."""
    rows = conformance.read_models_table(DOCS)
    assert len(rows) > 150, len(rows)
    counts = {s: sum(status == s for status, _ in rows.values()) for s in conformance.result.STATUSES}
    readme = README.read_text()
    block = readme[readme.index(conformance.report.README_BEGIN):readme.index(conformance.report.README_END)]
    assert (f"of {len(rows)} causal LMs, **{counts[EXACT]} exact, {counts[REFUSED]} refused with the cause, "
            f"{counts[FAIL]} FAIL, {counts[conformance.NOT_APPLICABLE]} not applicable**") in block, block
    version = DOCS.read_text().split("with transformers ", 1)[1].split()[0].rstrip(",")
    assert f"For transformers {version} " in block, (version, block)


def test_read_models_table_reads_escaped_cells(tmp_path):
    results = [conformance.CheckResult("a", EXACT, logits_err=1e-7, grad_err=1e-7, generate="equal"),
               conformance.CheckResult("b", REFUSED, reason="x | y")]
    path = tmp_path / "models.md"
    path.write_text(conformance.markdown_table(results, title="T", seconds=60))
    assert conformance.read_models_table(path) == {"a": (EXACT, ""), "b": (REFUSED, "x | y")}


def test_readme_summary_block_is_replaced_between_its_markers():
    begin, end = conformance.report.README_BEGIN, conformance.report.README_END
    text = f"# x\n{begin}\nold\n{end}\ntail\n"
    results = [conformance.CheckResult("a", EXACT, transformers="9.9"),
               conformance.CheckResult("b", REFUSED, reason="mamba ... carry state across the whole row",
                                       transformers="9.9")]
    new = conformance.replace_readme_summary(text, conformance.readme_summary(results))
    assert new.startswith(f"# x\n{begin}\nFor transformers 9.9 ") and new.endswith(f"{end}\ntail\n")
    assert "old" not in new and "other token mixers" in new and "(1)" in new
    with pytest.raises(ValueError, match="no summary block"):
        conformance.replace_readme_summary("# x\n", "s")


def test_reasons_are_cut_between_words():
    text = "UnsupportedModel: " + " ".join(f"word{i}" for i in range(100))
    short = conformance.shorten(text, 80)
    assert len(short) <= 80 and short.endswith("...")
    assert short[:-3] in text and text[len(short) - 3] == " "  # the cut falls on a space
    assert conformance.shorten("a  b\nc", 80) == "a b c"
    err = NotImplementedError(text)
    assert conformance.describe_error(err) == f"NotImplementedError: {text}"  # in full when it fits


def test_check_tool_mistakes_get_one_line_with_the_fix():
    assert conformance.usage_error(["llama"], 1, environ={}) is None
    launched = conformance.usage_error(["llama"], 3, environ={"WORLD_SIZE": "2"})
    assert "run it as one process" in launched and "WORLD_SIZE=2" in launched
    assert ">= 1" in conformance.usage_error(["llama"], 0, environ={})
    assert "at most" in conformance.usage_error(["llama"], 1000, environ={})
    assert "did you mean llama" in conformance.usage_error(["lama"], 1, environ={})


@pytest.mark.slow
def test_cli_under_its_old_name_prints_one_line_without_transformers_warnings():
    """``python -m hf_blockdiag_cp.check`` is unchanged; it causes no ``torch_dtype`` deprecation warning;
    a mistake ends in one line on stderr, not a traceback."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    env.pop("WORLD_SIZE", None)
    # Both at once: each is a fresh interpreter spending ~10 s of one core on imports.
    good = subprocess.Popen([sys.executable, "-m", "hf_blockdiag_cp.check", "llama", "--no-generate"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    bad = subprocess.Popen([sys.executable, "-m", "hf_blockdiag_cp.check", "llama", "--cp-size", "2"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**env, "WORLD_SIZE": "2"})
    try:
        proc = subprocess.CompletedProcess(good.args, 0, *good.communicate(timeout=240))
        proc.returncode = good.returncode
        assert proc.returncode == 0 and proc.stdout.startswith("llama: exact"), proc.stdout + proc.stderr
        assert "torch_dtype" not in proc.stderr + proc.stdout, proc.stderr
        proc = subprocess.CompletedProcess(bad.args, 0, *bad.communicate(timeout=240))
        proc.returncode = bad.returncode
    finally:
        good.kill()
        bad.kill()
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert proc.stderr.count("\n") == 1 and "not under torchrun" in proc.stderr, proc.stderr


def test_runtime_never_imports_the_conformance_tooling():
    """conformance/ (and its ``check`` shim) may import the runtime, never the other way round."""
    from tests.package.import_graph import import_graph

    graph = import_graph()
    assert "data" in graph["conformance"], graph["conformance"]  # the walk sees the subpackage's imports
    users = sorted(unit for unit, targets in graph.items() if targets & {"conformance", "check"} and unit != "check")
    assert users == [], users


def test_bigbird_pegasus_generate_is_not_falsely_refused():
    assert check_model("bigbird_pegasus").generate == "equal"


def test_check_reports_fail_for_wrong_attention(monkeypatch):
    """The check can fail: planning every row as one causal sequence (documents attending to each
    other) must be reported as FAIL with large numbers."""
    from hf_blockdiag_cp.attention import keywords

    original = keywords.build_varlen_plan

    def one_sequence(doc_ids, **kwargs):
        return original(torch.ones_like(torch.as_tensor(doc_ids)), **kwargs)

    monkeypatch.setattr(keywords, "build_varlen_plan", one_sequence)
    result = check_model("llama", generate=False, variants=("position_ids",))
    assert result.status == FAIL and result.logits_err > 1e-2, result.line()


def test_cli_prints_one_line_and_json(capsys):
    assert conformance.main(["llama", "--no-generate"]) == 0
    assert capsys.readouterr().out.startswith("llama: exact")
    # A refused model exits 3 (documented in --help), not 0.
    assert conformance.main(["inkling2_text", "--no-generate", "--json"]) == 3
    data = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert data["status"] == REFUSED and "carry state" in data["reason"]


def test_local_config_folder_is_checked(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
                intermediate_size=1024, vocab_size=1000).save_pretrained(tmp_path)
    config = conformance.tiny_config(str(tmp_path))
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, conformance.VOCAB)
    assert check_model(str(tmp_path), generate=False).status == EXACT


def test_markdown_table_counts():
    results = [conformance.CheckResult("a", EXACT, logits_err=1e-7, grad_err=1e-7, generate="equal"),
               conformance.CheckResult("b", REFUSED, reason="x | y"),
               conformance.CheckResult("c", conformance.NOT_APPLICABLE)]
    text = conformance.markdown_table(results, title="T", seconds=60)
    assert "**1 exact, 1 refused, 0 FAIL, 1 not applicable.**" in text
    assert "| `b` | refused |" in text and "x \\| y" in text


def test_markdown_has_a_cp2_column_and_says_when_every_exact_architecture_ran_at_cp2(tmp_path):
    results = [conformance.CheckResult("a", EXACT), conformance.CheckResult("b", EXACT),
               conformance.CheckResult("c", REFUSED, reason="r")]
    both = [conformance.CheckResult("a", EXACT, cp_size=2), conformance.CheckResult("b", REFUSED, reason="q",
                                                                                     cp_size=2)]
    text = conformance.markdown_table(results, title="T", seconds=60, cp2=both)
    assert "| model type | result | CP = 2 |" in text
    assert "| `a` | exact | exact |" in text and "| `b` | exact | refused |" in text
    assert "| `c` | refused | not run |" in text
    assert "every architecture exact at CP = 1" in text
    assert "a sample of the exact ones" in conformance.markdown_table(results, title="T", seconds=60, cp2=both[:1])
    (tmp_path / "models.md").write_text(text)
    assert conformance.read_models_table(tmp_path / "models.md") == {"a": (EXACT, ""), "b": (EXACT, ""),
                                                                     "c": (REFUSED, "r")}


#: Stands in for ``python``: ``-m hf_blockdiag_cp.check M... --cp-size N --json [--no-generate]`` prints one JSON
#: line per model in order, dies (no line, exit 1) at a model named "crash", and logs each call's models.
_FAKE_CHECK = """#!{python}
import json, sys
args = sys.argv[3:]
models = [a for a in args[:args.index("--cp-size")]]
with open({log!r}, "a") as log:
    log.write(" ".join(models) + (" no-generate" if "--no-generate" in args else "") + "\\n")
for m in models:
    if m == "crash":
        sys.exit(1)
    print(json.dumps({{"model": m, "status": "exact", "cp_size": int(args[args.index("--cp-size") + 1])}}), flush=True)
"""


def test_batched_sweep_reports_every_model_and_isolates_the_one_that_kills_its_process(tmp_path, monkeypatch):
    import importlib

    sweep_module = importlib.import_module("hf_blockdiag_cp.conformance.sweep")  # the package exports sweep()

    log = tmp_path / "calls.log"
    fake = tmp_path / "fake_python"
    fake.write_text(_FAKE_CHECK.format(python=sys.executable, log=str(log)))
    fake.chmod(0o755)
    results = sweep_module.run_batch(["a", "crash", "b"], 2, 60, python=str(fake), generate=False)
    assert [(r.model, r.status) for r in results] == [("a", EXACT), ("crash", conformance.FAIL), ("b", EXACT)]
    assert "exited with 1" in results[1].reason
    # One process for the batch, then the unreported ones alone: the crash cannot take "b" down with it.
    assert log.read_text().splitlines() == ["a crash b no-generate", "crash no-generate", "b no-generate"]
    # sweep() with batch=2 writes every model once, in any order, and resumes from its JSON lines.
    monkeypatch.setattr(sweep_module.sys, "executable", str(fake))
    jsonl = tmp_path / "s.jsonl"
    monkeypatch.setattr(sweep_module, "run_batch", functools.partial(sweep_module.run_batch, python=str(fake)))
    out = sweep_module.sweep(["a", "b", "c"], cp_size=2, timeout=60, jsonl=jsonl, jobs=2, batch=2)
    assert [r.model for r in out] == ["a", "b", "c"] and len(jsonl.read_text().splitlines()) == 3
    log.unlink()
    assert [r.model for r in sweep_module.sweep(["a", "b", "c"], cp_size=2, timeout=60, jsonl=jsonl)] == ["a", "b", "c"]
    assert not log.exists()  # everything came from the JSON lines


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("model_type", ["llama", "gpt2", "llama4_text", "qwen2"])
def test_cp2_sample(model_type):
    result = check_model(model_type, cp_size=2, generate=False)
    assert result.status == EXACT, result.line() + "\n" + json.dumps(result.variants, indent=1)


@pytest.mark.slow
@pytest.mark.timeout(7200)
@pytest.mark.skipif(not os.environ.get("HF_BLOCKDIAG_CP_FULL_SWEEP"),
                    reason="set HF_BLOCKDIAG_CP_FULL_SWEEP=1 to run it (20-45 min on 2 CPU cores; "
                           "`python -m hf_blockdiag_cp.check --all` writes docs/models.md from the same sweep)")
def test_full_sweep_has_no_fail(tmp_path):
    """Every causal LM of the installed transformers is exact, refused with a reason, or not applicable."""
    results = conformance.sweep(conformance.causal_lm_types(), cp_size=1, timeout=300, jsonl=tmp_path / "sweep.jsonl")
    failures = [r.line() for r in results if r.status == FAIL]
    assert not failures, "\n".join(failures)


def test_cp_size_2_names_the_cp_reason_first_and_refused_exits_3(monkeypatch, capsys):
    from hf_blockdiag_cp.conformance import compare

    def refuse_cp1(*args, **kwargs):
        raise NotImplementedError("the CP=1 reason")

    def refuse_cp(*args, **kwargs):
        raise NotImplementedError("the CP reason")

    monkeypatch.setattr(compare, "packed_run", refuse_cp1)
    monkeypatch.setattr(compare, "run_cp", refuse_cp)
    assert conformance.main(["llama", "--no-generate", "--cp-size", "2"]) == 3
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("llama: refused (NotImplementedError: the CP reason)"), line
    # The generate() column says it ran unpacked, so "equal" next to "refused" does not read as a contradiction.
    assert "unpacked generate() not run" in line, line
