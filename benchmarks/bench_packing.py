"""Packing efficiency: padding fraction of best-fit-decreasing vs greedy first-fit / next-fit.

Document lengths are lognormal (median ``median`` tokens, sigma ``sigma``) clipped to [1, 8*seq_len];
documents longer than ``seq_len`` are split into ``seq_len`` pieces first (``overflow="split"``), as
the collator does. Prints a Markdown table; ``--buffer`` packs a stream in buffers of that many
documents (as :class:`hf_blockdiag_cp.PackedDataset` does) instead of all at once. The greedy
baselines live here, not in the package: nothing but this comparison uses them.

    python benchmarks/bench_packing.py
    python benchmarks/bench_packing.py --seq-len 8192 --medians 600 --docs 20000 --buffer 1000
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Sequence

from hf_blockdiag_cp.data.packing import best_fit_decreasing, split_overflow


def first_fit(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Greedy first-fit in arrival order: each item goes into the earliest bin with room.

    Sizes must be in ``[1, capacity]`` (unchecked; :func:`split_overflow` pieces are).
    """
    bins: list[list[int]] = []
    room: list[int] = []
    for item, size in enumerate(sizes):
        b = next((b for b, left in enumerate(room) if left >= size), len(bins))
        if b == len(bins):
            bins.append([])
            room.append(capacity)
        bins[b].append(item)
        room[b] -= size
    return bins


def next_fit(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Sequential greedy packing: fill the current bin in arrival order, open a new one when an
    item does not fit (what "concatenate and cut" pipelines do when they must not cut documents)."""
    bins: list[list[int]] = []
    room = 0
    for item, size in enumerate(sizes):
        if size > room:
            bins.append([])
            room = capacity
        bins[-1].append(item)
        room -= size
    return bins


def padding_fraction(rows: int, tokens: int, capacity: int) -> float:
    """Fraction of the ``rows * capacity`` slots not holding one of ``tokens`` tokens (0 for no rows)."""
    return 0.0 if rows == 0 else 1.0 - tokens / (rows * capacity)


PACKERS = {"best_fit_decreasing": best_fit_decreasing, "first_fit": first_fit, "next_fit (concatenate)": next_fit}


def lognormal_lengths(n: int, median: float, sigma: float, max_len: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [min(max_len, max(1, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def measure(lengths: list[int], seq_len: int, buffer: int | None) -> dict[str, tuple[float, int, float]]:
    """Per packer: (padding fraction, rows, seconds)."""
    sizes = [p.length for p in split_overflow(lengths, seq_len, "split")]
    chunks = [sizes] if buffer is None else [sizes[i:i + buffer] for i in range(0, len(sizes), buffer)]
    out = {}
    for name, packer in PACKERS.items():
        start = time.perf_counter()
        rows = sum(len(packer(chunk, seq_len)) for chunk in chunks)
        seconds = time.perf_counter() - start
        out[name] = (padding_fraction(rows, sum(sizes), seq_len), rows, seconds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096, help="tokens per packed row")
    parser.add_argument("--docs", type=int, default=10000, help="documents drawn per seed")
    parser.add_argument("--medians", type=float, nargs="+", default=[200.0, 600.0, 1500.0],
                        help="median document lengths (one table row each)")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the document lengths")
    parser.add_argument("--seeds", type=int, default=3, help="seeds averaged per row")
    parser.add_argument("--buffer", type=int, default=None, help="documents per packing buffer (default: all)")
    args = parser.parse_args()
    print(f"seq_len={args.seq_len}, {args.docs} documents, lognormal sigma={args.sigma}, "
          f"buffer={args.buffer or 'all'}, mean over {args.seeds} seeds\n")
    print("| median doc len | mean doc len | packer | padding fraction | rows | lower bound rows | time (s) |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for median in args.medians:
        results: dict[str, list[tuple[float, int, float]]] = {name: [] for name in PACKERS}
        bounds, means = [], []
        for seed in range(args.seeds):
            lengths = lognormal_lengths(args.docs, median, args.sigma, 8 * args.seq_len, seed)
            means.append(statistics.mean(lengths))
            bounds.append(math.ceil(sum(lengths) / args.seq_len))
            for name, value in measure(lengths, args.seq_len, args.buffer).items():
                results[name].append(value)
        for name, values in results.items():
            pad = statistics.mean(v[0] for v in values)
            rows = statistics.mean(v[1] for v in values)
            secs = statistics.mean(v[2] for v in values)
            print(f"| {median:.0f} | {statistics.mean(means):.0f} | {name} | {pad:.2%} | {rows:.0f} | "
                  f"{statistics.mean(bounds):.0f} | {secs:.3f} |")


if __name__ == "__main__":
    main()
