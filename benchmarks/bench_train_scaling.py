"""Throughput and peak memory of the training example at CP = 1 vs CP = 2, and the longest row that
fits a memory budget.

Runs examples/train_packed_cp.py as real processes: CP = 1 as one process (all cores), CP = 2 with
`accelerate launch --config_file configs/accelerate/cpu_cp2.yaml` (one core each on a 2-core box), on
the same total sequence length, and reads each run's --summary-json.

    python benchmarks/bench_train_scaling.py --seq-lens 8192 32768 --steps 4
    python benchmarks/bench_train_scaling.py --max-memory-gib 20 --steps 2     # longest seq_len per CP size
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cp_size: int, seq_len: int, steps: int, extra: list[str]) -> dict | None:
    """One training run; ``None`` if it failed (e.g. killed for memory)."""
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "summary.json"
        script = [str(ROOT / "examples" / "train_packed_cp.py"), "--cp-size", str(cp_size), "--seq-len", str(seq_len),
                  "--steps", str(steps), "--no-progress", "--summary-json", str(summary), *extra]
        if cp_size == 1:
            cmd = [sys.executable, *script]
        else:
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "configs" / "accelerate" / "cpu_cp2.yaml"), *script]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ})
        if proc.returncode != 0 or not summary.exists():
            sys.stderr.write(f"cp={cp_size} seq_len={seq_len} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}\n")
            return None
        return json.loads(summary.read_text())


def table(seq_lens: list[int], steps: int, extra: list[str]) -> None:
    print("| seq_len | CP | processes | tokens/s | peak RSS per rank (GiB) | K/V exchanged per step per rank (MiB) |")
    print("|---:|---:|---:|---:|---|---|")
    for seq_len in seq_lens:
        for cp in (1, 2):
            r = run(cp, seq_len, steps, extra)
            if r is None:
                print(f"| {seq_len} | {cp} | {cp} | failed | | |")
                continue
            peaks = ", ".join(f"{g:.2f}" for g in r["peak_memory_gib_per_rank"])
            kv = ", ".join(f"{b / 2**20:.1f}" for b in r["kv_exchange_bytes_per_step_per_rank"])
            print(f"| {seq_len} | {cp} | {r['world']} | {r['tokens_per_s']:,.0f} | {peaks} | {kv} |", flush=True)


def longest(cp: int, budget_gib: float, steps: int, start: int, extra: list[str], scope: str) -> None:
    """Doubling then bisection (to a multiple of 4096 * cp) on the largest seq_len whose peak RSS stays
    within the budget, per rank (``scope="rank"``) or summed over the CP ranks (``"total"``)."""
    def fits(seq_len: int) -> bool:
        r = run(cp, seq_len, steps, extra)
        peaks = r["peak_memory_gib_per_rank"] if r else [float("inf")]
        peak = max(peaks) if scope == "rank" else sum(peaks)
        print(f"  cp={cp} seq_len={seq_len}: peak RSS {', '.join(f'{g:.2f}' for g in peaks)} GiB -> "
              f"{'fits' if peak <= budget_gib else 'does not fit'}", flush=True)
        return peak <= budget_gib

    lo, hi = 0, start
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 4096 * cp:
        mid = (lo + hi) // 2 // (4096 * cp) * (4096 * cp)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    print(f"| {cp} | {lo} | {budget_gib} GiB {'per rank' if scope == 'rank' else 'for all CP ranks together'} |",
          flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--max-memory-gib", type=float, default=None, help="find the longest seq_len within this budget")
    p.add_argument("--start", type=int, default=65536, help="first seq_len of the search")
    p.add_argument("--scope", choices=["rank", "total"], default="rank",
                   help="budget per rank, or for the CP ranks together (when they share one machine's memory)")
    p.add_argument("extra", nargs="*", help="more options for the example (after --)")
    args = p.parse_args()
    if args.max_memory_gib is None:
        table(args.seq_lens, args.steps, args.extra)
        return
    print("| CP | longest seq_len that trained | budget |")
    print("|---:|---:|---|")
    for cp in (1, 2):
        longest(cp, args.max_memory_gib, args.steps, args.start, args.extra, args.scope)


if __name__ == "__main__":
    main()
