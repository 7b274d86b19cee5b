"""Every fenced ``python`` block of README.md and docs/*.md runs as written (issue 28).

A block runs on 2 gloo ranks under a launcher's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` of a store
the test process serves, and no process group yet: whatever the block builds first creates it, as under
``torchrun``), in a namespace that holds only what a reader brings: ``path``/``name`` (a tiny Llama saved on disk),
``tok``/``tokenizer`` (a byte tokenizer), ``tokenized_docs``/``tokenized_dataset``/``docs`` (tokenised documents),
``ds`` (``{"train", "test"}`` ``datasets.Dataset`` of text), ``seq_len``, ``cp_size``, ``bd`` (the package, as
every page imports it); ``model`` and ``mesh`` only
for a block that uses them without making them. Markers on the line before a fence:

- ``<!-- docs-test: skip REASON -->``: not run (signatures, fragments); counted and listed by
  :func:`test_skipped_blocks_are_few_and_say_why`;
- ``<!-- docs-test: replace OLD => NEW -->``: the block runs with ``OLD`` replaced (e.g. ``max_steps=1000`` by 2).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.launch import run_ranks

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*docs-test:\s*(skip|replace)\s*(.*?)\s*-->")
MAX_SKIPPED = 3


def python_blocks(text: str) -> list[tuple[int, str, list[tuple[str, str]]]]:
    """``(line, code, markers)`` of every fenced ``python`` block (``markers``: ``(kind, argument)`` pairs)."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, markers = i, []
            j = i - 1
            while j >= 0 and MARKER.fullmatch(lines[j].strip()):
                markers.append(MARKER.fullmatch(lines[j].strip()).groups())
                j -= 1
            i += 1
            body = []
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append((start + 1, "\n".join(body) + "\n", markers))
        i += 1
    return blocks


def _all_blocks() -> list[tuple[str, str, list]]:
    return [(f"{f.relative_to(ROOT)}:{line}", code, markers) for f in FILES
            for line, code, markers in python_blocks(f.read_text(encoding="utf-8"))]


def _runnable(code: str, markers: list) -> str:
    for kind, argument in markers:
        if kind == "replace":
            old, new = (part.strip() for part in argument.split("=>"))
            assert old in code, f"replace marker: {old!r} is not in the block"
            code = code.replace(old, new)
    return code


def _free_names(code: str) -> set[str]:
    """Names the block reads without assigning them first (roughly: loaded but never stored or imported)."""
    tree = ast.parse(code)
    stored = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    stored |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
               for a in n.names}
    stored |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    stored |= {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return loaded - stored


def _reader_namespace(tmp: str, rank: int) -> dict:
    """What a reader brings to a snippet (see the module docstring), all small and offline."""
    import json

    import datasets
    import torch
    import transformers

    import examples.common as common

    tokenizer = common.byte_chat_tokenizer()
    with open(ROOT / "configs" / "model" / "tiny-llama.json", encoding="utf-8") as fh:
        config = json.load(fh)
    config.update(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    path = f"{tmp}/model{rank}"
    model.save_pretrained(path)
    texts = [f"Document {i}: " + "packed rows of documents " * (1 + i % 4) for i in range(12)]
    tokenized = [{"input_ids": tokenizer(t)["input_ids"] + [tokenizer.eos_token_id]} for t in texts]
    import hf_blockdiag_cp as bd

    return {"bd": bd, "path": path, "name": path, "tok": tokenizer, "tokenizer": tokenizer, "tokenized_docs": tokenized,
            "tokenized_dataset": tokenized, "docs": tokenized, "seq_len": 64, "cp_size": 2,
            "ds": {"train": datasets.Dataset.from_list([{"text": t} for t in texts]),
                   "test": datasets.Dataset.from_list([{"text": t} for t in texts[:4]])}}


def _run_block(rank: int, world: int, code: str, tmp: str) -> str:
    import builtins
    import os

    import transformers

    import hf_blockdiag_cp as bd

    os.chdir(f"{tmp}")  # output_dir="out" and the like land in the test's directory
    namespace = _reader_namespace(tmp, rank)
    free = _free_names(code)
    if "model" in free:
        namespace["model"] = transformers.AutoModelForCausalLM.from_pretrained(namespace["path"],
                                                                               attn_implementation="blockdiag_cp")
    if "mesh" in free:
        namespace["mesh"] = bd.init_device_mesh(2)
    missing = sorted(free - set(namespace) - set(dir(builtins)))
    assert not missing, f"the block reads names nobody defines: {missing}"
    exec(compile(code, "<doc block>", "exec"), {"__name__": "__doc_block__", **namespace})
    return "ok"


def _rank_env(world: int) -> dict[int, dict[str, str]]:
    return {r: {"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"} for r in range(world)}


def _params() -> list:
    params = []
    for where, code, markers in _all_blocks():
        skip = [argument for kind, argument in markers if kind == "skip"]
        marks = [pytest.mark.skip(reason=f"docs-test: skip {skip[0]}")] if skip else []
        params.append(pytest.param(code, markers, id=where, marks=marks))
    return params


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("code", "markers"), _params())
def test_doc_block_runs_as_written(code: str, markers: list, tmp_path) -> None:
    assert run_ranks(_run_block, 2, _runnable(code, markers), str(tmp_path), timeout=400, env=_rank_env(2),
                     init_group=False) == ["ok", "ok"]


def test_skipped_blocks_are_few_and_say_why(capsys) -> None:
    blocks = _all_blocks()
    skipped = [(where, argument) for where, _, markers in blocks for kind, argument in markers if kind == "skip"]
    with capsys.disabled():
        print(f"\ndocs blocks: {len(blocks)}, run {len(blocks) - len(skipped)}, skipped {len(skipped)}: {skipped}")
    assert all(reason for _, reason in skipped), skipped
    assert len(skipped) <= MAX_SKIPPED, f"{len(skipped)} python blocks of the docs are not run: {skipped}"
    assert len(blocks) >= 8


def test_markers_are_read() -> None:
    text = "x\n<!-- docs-test: skip GPU only -->\n```python\na = 1\n```\n```python\nb = a\n```\n"
    (first, second) = python_blocks(text)
    assert first[2] == [("skip", "GPU only")] and second[2] == [] and _free_names(second[1]) == {"a"}
    assert _runnable("max_steps=1000\n", [("replace", "max_steps=1000 => max_steps=2")]) == "max_steps=2\n"
