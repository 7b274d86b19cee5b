"""Planning at scale: the collate time and context size of one CP rank, for long rows over many ranks.

Every CP rank runs ``PackingCollator(S, cp_size=P, cp_rank=r)`` on the same examples: packing, the
placement, the exchange plans of every window, its own varlen plans, fingerprints and shard checksums. The
plans are computed on runs (document pieces), so the time should stay near a few passes over the row
whatever ``P``. Documents have lognormal lengths (``--median`` tokens, ``--sigma``) as int64 tensors, filling
the row. Each time is the median of ``--repeats`` calls, compared with one O(S) tensor pass over the row
(``torch.cat`` of the documents + ``cumsum``): every call is paired with a pass measured just before it (the
pair sees the same machine load), and the ratio column is the median over the pairs of the slower rank's; each
pass is the median of 5 (a second column: their fastest, memory reused, the lower bound of a pass).
Runs on ``--threads`` CPU threads (default 1); times are this process's CPU time (``--clock cpu``, the default:
what a collate costs a dedicated core, little moved by other jobs on a shared machine) or wall time
(``--clock wall``); the load average is printed with the table.

    python benchmarks/bench_planning.py                               # S = 1M, P = 8 / 32 / 128, balanced
    python benchmarks/bench_planning.py --seq-lens 131072,1048576,4194304 --cp-sizes 8,32,128,256 \\
        --placements balanced,contiguous,zigzag --windows none,4096 --ulysses 1,auto --out bench_planning.png
"""

from __future__ import annotations

import argparse
import os
import pickle
import statistics
import time
from typing import NamedTuple

import numpy as np
import torch

from hf_blockdiag_cp import PackingCollator
from hf_blockdiag_cp.planning.layout import HeadShape


class _NoGroups:
    """Stands in for ``hf_blockdiag_cp.ulysses_groups(...)``: planning needs only that subgroups exist."""

    def get(self, size: int) -> tuple[None, None]:
        return None, None


class Row(NamedTuple):
    """One measured configuration (a NamedTuple: the module also loads outside sys.modules, in tests)."""

    seq_len: int
    cp_size: int
    placement: str
    windows: str
    ulysses: str
    docs: int
    one_pass_s: float
    first_s: float
    last_s: float
    context_bytes: int
    ratio: float  # median over call/pass pairs of the slower rank's collate / one pass (the median of 5 passes)
    ratio_fastest: float  # the same against the fastest of the 5 passes (memory reused: conservative)

    @property
    def slowest_s(self) -> float:
        return max(self.first_s, self.last_s)


def documents(seq_len: int, median: float, sigma: float, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Lognormal-length documents (int64 token tensors) filling at most ``seq_len`` tokens."""
    rng = np.random.default_rng(seed)
    lengths, total = [], 0
    while True:
        n = int(rng.lognormal(np.log(median), sigma)) + 1
        if total + n > seq_len:
            break
        lengths.append(n)
        total += n
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 32_000, (n,), generator=gen)} for n in lengths]


#: The clock of every measurement: ``time.process_time`` (this process's CPU time: what a collate costs a
#: dedicated core, robust to other jobs on a shared machine) or ``time.perf_counter`` (wall time); ``--clock``.
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
clock = CLOCKS["cpu"]


def all_times(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return times


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def measure(examples, seq_len: int, cp_size: int, placement: str, windows: str, ulysses: str,
            repeats: int) -> Row:
    """One row: ranks 0 and P - 1, each call timed right after a one-pass baseline (the pair sees the same
    machine load), medians over ``repeats``; the two ranks' calls alternate."""
    sliding = None if windows == "none" else (None, int(windows))
    extra = {}
    if ulysses != "1":
        extra = dict(ulysses_size=ulysses if ulysses == "auto" else int(ulysses),
                     heads=HeadShape(num_q_heads=32, num_kv_heads=8, head_dim=128), ulysses_groups=_NoGroups())
    collators = [PackingCollator(seq_len, cp_size=cp_size, cp_rank=rank, pad_token_id=0, placement=placement,
                                 sliding_windows=sliding, **extra) for rank in (0, cp_size - 1)]
    size = max(len(pickle.dumps(c(examples)["cp_context"])) for c in collators)  # also warms both up
    passes: list[float] = []
    fastest: list[float] = []
    calls: list[list[float]] = [[], []]
    for _ in range(repeats):
        for k, collator in enumerate(collators):
            # 5 passes: their median (the pass as it runs, fresh memory's page faults included when the heap has
            # none to reuse) and their fastest (memory reused: the lower bound, for a conservative ratio).
            times = all_times(lambda: torch.cumsum(torch.cat([e["input_ids"] for e in examples]), 0), 5)
            passes.append(statistics.median(times))
            fastest.append(min(times))
            calls[k].append(median_time(lambda: collator(examples), 1))
    # Pair i of rank 0 is passes[2i], of rank P - 1 passes[2i + 1].
    ratios = [max(a / passes[2 * i], b / passes[2 * i + 1]) for i, (a, b) in enumerate(zip(*calls))]
    vs_fastest = [max(a / fastest[2 * i], b / fastest[2 * i + 1]) for i, (a, b) in enumerate(zip(*calls))]
    return Row(seq_len, cp_size, placement, windows, ulysses, len(examples), statistics.median(passes),
               statistics.median(calls[0]), statistics.median(calls[1]), size, statistics.median(ratios),
               statistics.median(vs_fastest))


def table(rows: list[Row]) -> str:
    lines = ["| S | P | placement | windows | ulysses | docs | one pass (ms) | rank 0 (s) | rank P-1 (s) "
             "| slowest / pass (paired median) | slowest / fastest pass | context (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.seq_len:,} | {r.cp_size} | {r.placement} | {r.windows} | {r.ulysses} | {r.docs} "
                     f"| {r.one_pass_s * 1e3:.1f} | {r.first_s:.3f} | {r.last_s:.3f} "
                     f"| {r.ratio:.1f}x | {r.ratio_fastest:.1f}x | {r.context_bytes / 2**20:.2f} |")
    return "\n".join(lines)


def acceptance(rows: list[Row]) -> list[str]:
    """Issue 25's checks where the rows measured them."""
    notes = []
    for key in {(r.placement, r.windows, r.ulysses) for r in rows}:
        at = {r.cp_size: r for r in rows if (r.placement, r.windows, r.ulysses) == key and r.seq_len == 1 << 20}
        ratios = {p: (at[p].ratio, at[p].ratio_fastest) for p in (8, 32, 128) if p in at}
        if ratios:
            notes.append(f"S=1M {key}: slowest rank / one pass (median pass; fastest pass) = "
                         + ", ".join(f"P={p}: {v:.1f}x; {w:.1f}x" for p, (v, w) in ratios.items())
                         + " (goal <= 20x)")
        if 8 in at and 128 in at:
            notes.append(f"S=1M {key}: P=128 / P=8 = {at[128].slowest_s / at[8].slowest_s:.2f} (goal <= 1.5)")
        big = [r for r in rows if (r.placement, r.windows, r.ulysses) == key and r.seq_len == 1 << 22
               and r.cp_size == 256]
        for r in big:
            notes.append(f"S=4M P=256 {key}: slowest rank {r.slowest_s:.2f} s (goal < 2 s on one core)")
    return notes


def plot(rows: list[Row], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed (pip install -e \".[bench]\"): no plot written to {path}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    combos = sorted({(r.placement, r.windows, r.ulysses) for r in rows})
    fig, axes = plt.subplots(1, len(combos), figsize=(5 * len(combos), 4), squeeze=False)
    for ax, combo in zip(axes[0], combos):
        for seq_len in sorted({r.seq_len for r in rows}):
            pts = sorted((r.cp_size, r.slowest_s) for r in rows
                         if (r.placement, r.windows, r.ulysses) == combo and r.seq_len == seq_len)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"S = {seq_len:,}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("CP ranks P")
        ax.set_ylabel("slowest rank's collate (s)")
        ax.set_title("placement={}, windows={}, ulysses={}".format(*combo), fontsize=9)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", default="1048576", help="comma-separated row lengths S")
    parser.add_argument("--cp-sizes", default="8,32,128", help="comma-separated CP sizes P (each must divide S)")
    parser.add_argument("--placements", default="balanced", help="comma-separated: balanced, contiguous, zigzag")
    parser.add_argument("--windows", default="none",
                        help="comma-separated: none (full causal) or a sliding window W (layers None and W)")
    parser.add_argument("--ulysses", default="1", help="comma-separated ulysses_size values: 1, auto, or an int")
    parser.add_argument("--median", type=float, default=1800.0, help="median document length (tokens)")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the document lengths")
    parser.add_argument("--repeats", type=int, default=7, help="calls per rank; the median is reported")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: one core)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu",
                        help="cpu: this process's CPU time (robust on a shared machine); wall: elapsed time")
    parser.add_argument("--out", default=None, help="write a plot (time vs P, one line per S) to this PNG")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global clock
    clock = CLOCKS[args.clock]
    print(f"clock: {args.clock} ({clock.__name__})", flush=True)
    print("load average (1, 5, 15 min) at start: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()), flush=True)
    rows = []
    for seq_len in (int(s) for s in args.seq_lens.split(",")):
        examples = documents(seq_len, args.median, args.sigma)
        for placement in args.placements.split(","):
            for windows in args.windows.split(","):
                for ulysses in args.ulysses.split(","):
                    for cp_size in (int(p) for p in args.cp_sizes.split(",")):
                        row = measure(examples, seq_len, cp_size, placement, windows, ulysses, args.repeats)
                        rows.append(row)
                        print(table([row]).splitlines()[-1], flush=True)
    print()
    print(table(rows))
    print("load average (1, 5, 15 min) at end: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    for note in acceptance(rows):
        print(note)
    if args.out:
        plot(rows, args.out)


if __name__ == "__main__":
    main()
