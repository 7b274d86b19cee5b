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

__all__ = ["cp2_sample", "read_jsonl", "run_isolated", "sweep"]


def _limit_memory() -> None:
    """Cap a sweep subprocess's address space (``HF_BLOCKDIAG_CP_CHECK_MAX_GB``, default 10): a config the
    generic shrinking misses raises MemoryError instead of waking the kernel's OOM killer."""
    limit = int(float(os.environ.get("HF_BLOCKDIAG_CP_CHECK_MAX_GB", "10")) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def run_isolated(model: str, cp_size: int, timeout: float, python: str = sys.executable) -> CheckResult:
    """One architecture's check (``python -m hf_blockdiag_cp.check MODEL --json``) in a subprocess."""
    cmd = [python, "-m", "hf_blockdiag_cp.check", model, "--cp-size", str(cp_size), "--json"]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ},
                              preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired:
        return CheckResult(model=model, status=FAIL, reason=f"timed out after {timeout:.0f} s", cp_size=cp_size,
                           seconds=time.monotonic() - start)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            result = CheckResult(**json.loads(line))
            result.seconds = time.monotonic() - start  # wall time, process start-up included
            return result
    tail = shorten((proc.stderr or proc.stdout)[-400:], 300)
    return CheckResult(model=model, status=FAIL, reason=f"check process exited with {proc.returncode}: {tail}",
                       cp_size=cp_size, seconds=time.monotonic() - start)


def _read(path: Path) -> list[CheckResult]:
    return [CheckResult(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def read_jsonl(path: Path) -> tuple[list[CheckResult], list[CheckResult]]:
    """``(CP = 1 results, CP > 1 results)`` of a sweep's JSON lines (the last line per model wins)."""
    one: dict[str, CheckResult] = {}
    more: dict[str, CheckResult] = {}
    for r in _read(path):
        (one if r.cp_size == 1 else more)[r.model] = r
    return list(one.values()), list(more.values())


def sweep(models: Sequence[str], *, cp_size: int, timeout: float, jsonl: Path | None, jobs: int = 1
          ) -> list[CheckResult]:
    """Check ``models`` one subprocess each, ``jobs`` at a time; prints one line per model as it finishes,
    appends JSON lines to ``jsonl`` (and skips the models it already holds at this ``cp_size``). Returns
    the results in the order of ``models``."""
    done: dict[str, CheckResult] = {}
    if jsonl is not None and jsonl.exists():  # resume an interrupted sweep
        done = {r.model: r for r in _read(jsonl) if r.cp_size == cp_size}
    todo = [m for m in models if m not in done]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:  # threads only wait on subprocesses
        futures = [pool.submit(run_isolated, model, cp_size, timeout) for model in todo]
        for finished, future in enumerate(as_completed(futures), len(models) - len(todo) + 1):
            r = future.result()
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
