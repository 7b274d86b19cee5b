"""Head-parallel x sequence-parallel CP layouts (issue 18), host simulation.

For P = 2, 4, 8, 16 ranks, the head shapes of real models (Llama-3-8B 32/8 heads, Qwen2.5-7B 28/4,
an MHA model 32/32, all D = 128) and packed rows (lognormal documents of mean S/8 as in
``bench_balance.py``, and its heavy-tailed mix), every valid ``u`` (P = u x c) and the ``auto``
choice: the most bytes a rank moves per layer forward (bf16; head all-to-all plus K/V exchange
between the c groups), the max/mean attention work over ranks, and the modelled cost of one
layer's forward and backward (``hf_blockdiag_cp.planning.layout``: 400 TFLOP/s, 889 FLOP/byte by
default). Means over seeds; "auto picks" counts how often auto chose each u.

    python benchmarks/bench_cp_layouts.py                          # all P, 20 seeds, S = 16384
    python benchmarks/bench_cp_layouts.py --cp-sizes 8 --seeds 50
    python benchmarks/bench_cp_layouts.py --flops-per-byte 8889    # links 10x slower (e.g. between nodes)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_balance import make_row  # noqa: E402

from hf_blockdiag_cp import BlockDiagCPConfig  # noqa: E402
from hf_blockdiag_cp.config import DEFAULT_LAYOUT_FLOPS_PER_BYTE  # noqa: E402
from hf_blockdiag_cp.planning.layout import CostModel, HeadShape, LayoutCost, layout_costs  # noqa: E402

MODELS = {
    "Llama-3-8B (32/8)": HeadShape(32, 8, 128),
    "Qwen2.5-7B (28/4)": HeadShape(28, 4, 128),
    "MHA (32/32)": HeadShape(32, 32, 128),
}
ROWS = ("lognormal_8", "heavy_tail")
MIB = 2 ** 20


def auto_choice(costs: tuple[LayoutCost, ...]) -> LayoutCost:
    """What ``ulysses_size="auto"`` picks: the first (smallest u) of least cost."""
    best = costs[0]
    for cost in costs[1:]:
        if cost.cost_s < best.cost_s:
            best = cost
    return best


def simulate(cp_sizes: list[int], full_len: int, seeds: int, model: CostModel, placement: str) -> dict:
    """``{(rows, P, model name): {"table": {u: [LayoutCost per seed]}, "auto": [LayoutCost per seed]}}``."""
    config = BlockDiagCPConfig(placement=placement, layout_flops_per_byte=model.flops_per_byte)
    results = {}
    for kind in ROWS:
        rows = [make_row(kind, full_len, seed) for seed in range(seeds)]
        for cp_size in cp_sizes:
            for name, heads in MODELS.items():
                start = time.perf_counter()
                per_seed = [layout_costs(row, cp_size=cp_size, heads=heads, config=config, model=model)
                            for row in rows]
                table = {c.ulysses_size: [costs[i] for costs in per_seed] for i, c in enumerate(per_seed[0])}
                results[(kind, cp_size, name)] = {"table": table, "auto": [auto_choice(c) for c in per_seed],
                                                  "host_s": (time.perf_counter() - start) / seeds}
    return results


def print_tables(results: dict, full_len: int, seeds: int, model: CostModel) -> None:
    print(f"\n## Layouts per row kind, P and model (S={full_len}, {seeds} seeds, bf16, "
          f"{model.compute_flops / 1e12:.0f} TFLOP/s, {model.flops_per_byte:.0f} FLOP/byte)\n")
    print("| rows | P | model | layout | MiB moved per rank per layer (max rank) | max/mean work | "
          "modelled ms (fwd+bwd, one layer) | auto picks |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    for (kind, cp_size, name), r in results.items():
        picks = [c.ulysses_size for c in r["auto"]]
        for u, costs in r["table"].items():
            print(f"| {kind} | {cp_size} | {name} | u={u} x c={cp_size // u} | "
                  f"{statistics.mean(max(c.moved) for c in costs) / MIB:.2f} | "
                  f"{statistics.mean(c.imbalance for c in costs):.3f} | "
                  f"{statistics.mean(c.cost_s for c in costs) * 1e3:.3f} | {picks.count(u)}/{len(picks)} |")
        auto = r["auto"]
        print(f"| {kind} | {cp_size} | {name} | **auto** | {statistics.mean(max(c.moved) for c in auto) / MIB:.2f} | "
              f"{statistics.mean(c.imbalance for c in auto):.3f} | "
              f"{statistics.mean(c.cost_s for c in auto) * 1e3:.3f} | |")


def headline(results: dict, cp_size: int = 8, kind: str = "lognormal_8", name: str = "Llama-3-8B (32/8)") -> None:
    """Modelled cost of auto vs the best fixed u vs u = 1 on one configuration (means over seeds)."""
    r = results.get((kind, cp_size, name))
    if r is None:
        return
    fixed = {u: statistics.mean(c.cost_s for c in costs) for u, costs in r["table"].items()}
    best_u = min(fixed, key=lambda u: (fixed[u], u))
    auto = statistics.mean(c.cost_s for c in r["auto"])
    print(f"\n{kind}, P={cp_size}, {name}: modelled fwd+bwd ms per layer (mean of {len(r['auto'])} rows): "
          f"auto {auto * 1e3:.4f} | best fixed u={best_u} {fixed[best_u] * 1e3:.4f} | today's u=1 "
          f"{fixed[1] * 1e3:.4f} | auto vs u=1: {100 * (1 - auto / fixed[1]):.1f}% less, auto vs best fixed: "
          f"{100 * (1 - auto / fixed[best_u]):.1f}% less; planner host time {r['host_s'] * 1e3:.0f} ms per row "
          "(every valid u)")


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\n(matplotlib not installed: no plot; pip install -e '.[bench]' to get {path})")
        return
    names = list(MODELS)
    fig, axes = plt.subplots(len(ROWS), len(names), figsize=(5 * len(names), 4 * len(ROWS)), squeeze=False)
    for row_i, kind in enumerate(ROWS):
        for col, name in enumerate(names):
            ax = axes[row_i][col]
            for (k, cp_size, n), r in results.items():
                if k != kind or n != name:
                    continue
                us = sorted(r["table"])
                ax.plot([str(u) for u in us], [statistics.mean(c.cost_s for c in r["table"][u]) * 1e3 for u in us],
                        marker="o", label=f"P={cp_size}")
            ax.set_title(f"{kind}, {name}")
            ax.set_xlabel("u (ranks per head-parallel group)")
            ax.set_ylabel("modelled ms per layer (fwd+bwd)")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4, 8, 16], help="CP group sizes P")
    parser.add_argument("--seq-len", type=int, default=16384, help="row length S (divisible by every P)")
    parser.add_argument("--seeds", type=int, default=20, help="rows per row kind")
    parser.add_argument("--placement", default="balanced", help="placement of the c sequence groups")
    parser.add_argument("--compute-tflops", type=float, default=400.0, help="effective attention TFLOP/s")
    parser.add_argument("--flops-per-byte", type=float, default=DEFAULT_LAYOUT_FLOPS_PER_BYTE,
                        help="compute over bandwidth per direction (default 400 TFLOP/s / 450 GB/s)")
    parser.add_argument("--out", default="bench_cp_layouts.png", help="plot path (needs matplotlib)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = CostModel(compute_flops=args.compute_tflops * 1e12, flops_per_byte=args.flops_per_byte)
    results = simulate(args.cp_sizes, args.seq_len, args.seeds, model, args.placement)
    print_tables(results, args.seq_len, args.seeds, model)
    headline(results)
    plot(results, args.out)


if __name__ == "__main__":
    main()
