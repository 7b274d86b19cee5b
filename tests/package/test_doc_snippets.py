"""Every fenced ``python`` block of README.md and docs/*.md runs as written (issues 28 and 35).

A page is one reader's session: its blocks run top to bottom in one namespace that starts EMPTY (builtins only),
on 2 gloo ranks under a launcher's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` of a store the test
process serves, and no process group yet: whatever the blocks build first creates it, as under ``torchrun``). A
page whose blocks need a model, a tokenizer or data starts with a setup block of stand-ins (tiny, random, offline)
and says so; nothing is injected by the test. :func:`test_every_block_reads_only_names_its_page_defines` checks
that statically (fast); :func:`test_doc_page_runs_as_written` runs each page. Markers on the line before a fence:

- ``<!-- docs-test: skip REASON -->``: not run (signatures, fragments); counted and listed by
  :func:`test_skipped_blocks_are_few_and_say_why`;
- ``<!-- docs-test: replace OLD => NEW -->``: the block runs with ``OLD`` replaced (e.g. ``max_steps=1000`` by 2).
"""

from __future__ import annotations

import ast
import builtins
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


def _pages() -> dict[str, list[tuple[int, str]]]:
    """``{page: [(line, runnable code), ...]}`` of every page with a block that is not skipped."""
    pages: dict[str, list[tuple[int, str]]] = {}
    for f in FILES:
        blocks = [(line, _runnable(code, markers)) for line, code, markers in python_blocks(f.read_text("utf-8"))
                  if not any(kind == "skip" for kind, _ in markers)]
        if blocks:
            pages[str(f.relative_to(ROOT))] = blocks
    return pages


def _defined(tree: ast.AST) -> set[str]:
    """Names a block binds: assignments, imports, functions, classes, arguments."""
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    names |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
              for a in n.names}
    names |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return names | {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}


def _free_names(code: str, known: set[str] = frozenset()) -> set[str]:
    """Names the block reads that neither it, ``known`` (earlier blocks of the page) nor builtins define."""
    tree = ast.parse(code)
    loaded = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return loaded - _defined(tree) - set(known) - set(dir(builtins))


def test_every_block_reads_only_names_its_page_defines() -> None:
    """The NameErrors a reader would meet, found without running anything: each runnable block reads only names
    that it or an earlier block of its page defines."""
    problems = []
    for page, blocks in _pages().items():
        known: set[str] = set()
        for line, code in blocks:
            missing = _free_names(code, known)
            if missing:
                problems.append(f"{page}:{line} reads {sorted(missing)}")
            known |= _defined(ast.parse(code))
    assert not problems, problems


def _run_page(rank: int, world: int, blocks: list[tuple[int, str]], tmp: str) -> str:
    import os

    os.chdir(tmp)  # output_dir="out" and the like land in the test's directory
    namespace: dict = {"__name__": "__doc_page__"}
    for line, code in blocks:
        exec(compile(code, f"<doc block at line {line}>", "exec"), namespace)
    return "ok"


def _rank_env(world: int) -> dict[int, dict[str, str]]:
    return {r: {"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1",
                "HF_HUB_OFFLINE": "1"} for r in range(world)}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("page", sorted(_pages()))
def test_doc_page_runs_as_written(page: str, tmp_path) -> None:
    assert run_ranks(_run_page, 2, _pages()[page], str(tmp_path), timeout=400, env=_rank_env(2),
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
    assert _free_names(second[1], {"a"}) == set()
    assert _runnable("max_steps=1000\n", [("replace", "max_steps=1000 => max_steps=2")]) == "max_steps=2\n"
