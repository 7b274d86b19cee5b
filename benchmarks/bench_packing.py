"""Packing efficiency: padding fraction of best-fit-decreasing vs greedy first-fit / next-fit.

Document lengths are lognormal (median ``median`` tokens, sigma ``sigma``) clipped to [1, 8*seq_len];
documents longer than ``seq_len`` are split into ``seq_len`` pieces first (``overflow="split"``), as
the collator does. Prints a Markdown table; ``--buffer`` packs a stream in buffers of that many
documents (as :class:`hf_blockdiag_cp.PackedDataset` does) instead of all at once.

    python benchmarks/bench_packing.py
    python benchmarks/bench_packing.py --seq-len 8192 --median 600 --docs 20000 --buffer 1000
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

from hf_blockdiag_cp.data.packing import best_fit_decreasing, first_fit, next_fit, split_overflow

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
        out[name] = (1.0 - sum(sizes) / (rows * seq_len), rows, seconds)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--docs", type=int, default=10000)
    parser.add_argument("--medians", type=float, nargs="+", default=[200.0, 600.0, 1500.0])
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--seeds", type=int, default=3)
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
