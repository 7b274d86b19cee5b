"""The sweep: one subprocess per architecture (a crash, a hang or a memory blow-up cannot stop it), results
appended as JSON lines so an interrupted sweep resumes where it stopped."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict
from pathlib import Path

from .result import EXACT, FAIL, CheckResult, shorten

__all__ = ["cp2_sample", "read_jsonl", "read_jsonl_ulysses", "run_batch", "run_isolated", "sweep"]


def _limit_memory() -> None:
    """Cap a sweep subprocess's address space (``HF_BLOCKDIAG_CP_CHECK_MAX_GB``, default 10): a config the
    generic shrinking misses raises MemoryError instead of waking the kernel's OOM killer."""
    limit = int(float(os.environ.get("HF_BLOCKDIAG_CP_CHECK_MAX_GB", "10")) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def run_isolated(model: str, cp_size: int, timeout: float, python: str = sys.executable, *,
                 generate: bool = True, ulysses_size: int = 1) -> CheckResult:
    """One architecture's check (``python -m hf_blockdiag_cp.check MODEL --json``) in a subprocess."""
    return run_batch([model], cp_size, timeout, python, generate=generate, ulysses_size=ulysses_size)[0]


def run_batch(models: Sequence[str], cp_size: int, timeout: float, python: str = sys.executable, *,
              generate: bool = True, ulysses_size: int = 1) -> list[CheckResult]:
    """Several architectures' checks in one subprocess (``check M1 M2 ... --json``: one import of torch and
    transformers, and at ``cp_size`` > 1 one fork server for every CP run), ``timeout`` seconds per model.
    Models the process did not report (it crashed or timed out) are checked again one subprocess each, so a
    model that kills its process is reported alone; a single model's failure is a ``FAIL`` result."""
    cmd = [python, "-m", "hf_blockdiag_cp.check", *models, "--cp-size", str(cp_size), "--json"]
    if ulysses_size > 1:
        cmd += ["--ulysses-size", str(ulysses_size)]
    if not generate:
        cmd.append("--no-generate")
    start = time.monotonic()
    failure, stdout = "", ""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout * len(models),
                              env={**os.environ}, preexec_fn=_limit_memory)
        stdout = proc.stdout
        failure = f"check process exited with {proc.returncode}: {shorten((proc.stderr or proc.stdout)[-400:], 300)}"
    except subprocess.TimeoutExpired as err:
        out = err.stdout or ""
        stdout = out.decode(errors="replace") if isinstance(out, bytes) else out
        failure = f"timed out after {timeout * len(models):.0f} s"
    reported = [CheckResult(**json.loads(line)) for line in stdout.splitlines() if line.startswith("{")]
    elapsed = time.monotonic() - start
    for r in reported:  # wall time, the process's start-up shared out
        r.seconds = elapsed / len(models)
    if len(reported) == len(models):
        return reported
    if len(models) > 1:  # who broke the process? each of the rest alone
        return reported + [run_isolated(m, cp_size, timeout, python, generate=generate, ulysses_size=ulysses_size)
                           for m in models[len(reported):]]
    return [CheckResult(model=models[0], status=FAIL, reason=failure, cp_size=cp_size, ulysses_size=ulysses_size,
                        seconds=elapsed)]


def _read(path: Path) -> list[CheckResult]:
    """The causal-LM results of a sweep's JSON lines (image-text-to-text verdicts: :func:`.vlm_runs.read_vlm_jsonl`)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [CheckResult(**row) for row in rows if "images" not in row]


def read_jsonl(path: Path) -> tuple[list[CheckResult], list[CheckResult]]:
    """``(CP = 1 results, CP > 1 results)`` of a sweep's JSON lines (the last line per model wins; head-parallel
    results: :func:`read_jsonl_ulysses`)."""
    one: dict[str, CheckResult] = {}
    more: dict[str, CheckResult] = {}
    for r in _read(path):
        if r.ulysses_size == 1:
            (one if r.cp_size == 1 else more)[r.model] = r
    return list(one.values()), list(more.values())


def read_jsonl_ulysses(path: Path) -> list[CheckResult]:
    """The head-parallel (``ulysses_size > 1``) results of a sweep's JSON lines (the last line per model wins)."""
    return list({r.model: r for r in _read(path) if r.ulysses_size > 1}.values())


def sweep(models: Sequence[str], *, cp_size: int, timeout: float, jsonl: Path | None, jobs: int = 1,
          batch: int = 1, generate: bool = True, ulysses_size: int = 1) -> list[CheckResult]:
    """Check ``models``, ``batch`` per subprocess (:func:`run_batch`), ``jobs`` subprocesses at a time; prints one
    line per model as it finishes, appends JSON lines to ``jsonl`` (and skips the models it already holds at this
    ``cp_size`` and ``ulysses_size``). Returns the results in the order of ``models``."""
    done: dict[str, CheckResult] = {}
    if jsonl is not None and jsonl.exists():  # resume an interrupted sweep
        done = {r.model: r for r in _read(jsonl) if (r.cp_size, r.ulysses_size) == (cp_size, ulysses_size)}
    todo = [m for m in models if m not in done]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:  # threads only wait on subprocesses
        size = max(1, batch)
        futures = [pool.submit(run_batch, todo[i:i + size], cp_size, timeout, generate=generate,
                               ulysses_size=ulysses_size)
                   for i in range(0, len(todo), size)]
        finished = len(models) - len(todo)
        for future in as_completed(futures):
            for r in future.result():
                finished += 1
                done[r.model] = r
                print(f"[{finished}/{len(models)}] {r.line()}", flush=True)
                if jsonl is not None:  # written by this thread only
                    with jsonl.open("a") as f:
                        f.write(json.dumps(asdict(r)) + "\n")
    return [done[m] for m in models]


def cp2_sample(results: Sequence[CheckResult], size: int, also: Sequence[str] = ()) -> list[str]:
    """The architectures checked at CP = 2: ``size`` exact ones spread evenly over the sweep's order, then
    those of ``also`` not already in it."""
    exact = [r.model for r in results if r.status == EXACT]
    step = max(1, len(exact) // size) if size else 1
    picked = exact[::step][:size] if size else []
    return picked + [m for m in also if m not in picked]
