"""Wall time of one attention layer's forward+backward per ``u x c`` layout, on real gloo processes.

For P = 2 and 4 CP ranks on this machine (CPU, one thread per rank, bf16, ``sdpa_doc`` kernel), a
packed row of lognormal document lengths (mean S/8), heads Hq=8, Hkv=2, D=64: every valid
``ulysses_size`` and ``auto``, through the registered ``blockdiag_cp`` attention function (agreement,
head all-to-all, K/V exchange, kernel, all-to-all back), median over iterations, max over ranks; with
the bytes each rank moved per layer (forward + backward, counted).

    python benchmarks/bench_layout_wall.py [--seq-len 4096] [--iters 3] [--cp-sizes 2 4] [--out PNG]

The plot (``--out``, needs matplotlib): per P, the wall time (median, min-max whiskers over the timed
iterations) and the bytes sent, one bar per layout that ran (coloured by ``u``); ``auto`` is named under the
layout it chose, not drawn as a second bar of the same layout.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_exchange import _free_port, lognormal_row  # noqa: E402

HEADS, KV_HEADS, DIM = 8, 2, 64
#: One colour per ulysses_size u that ran (``auto`` takes the colour of its choice, hatched).
U_COLORS = {1: "tab:blue", 2: "tab:orange", 4: "tab:green", 8: "tab:red", 16: "tab:purple"}


def _sizes(world: int) -> list:
    from hf_blockdiag_cp.planning.layout import HeadShape, valid_ulysses_sizes

    return [*valid_ulysses_sizes(world, HeadShape(HEADS, KV_HEADS, DIM)), "auto"]


def _worker(rank: int, world: int, port: int, full_len: int, iters: int, results) -> None:
    import torch.distributed as dist

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp import comm_stats
    from hf_blockdiag_cp.integration import blockdiag_cp_attention
    from hf_blockdiag_cp.planning.layout import HeadShape

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    config0 = bd.BlockDiagCPConfig(backend="sdpa_doc", collective_timeout_s=300)
    groups = bd.ulysses_groups(None, "auto", config=config0)
    row = lognormal_row(full_len, full_len / 8, 1.0, torch.Generator().manual_seed(0))
    local = full_len // world
    module = torch.nn.Module()
    warnings.simplefilter("ignore")
    out = {}
    for u in _sizes(world):
        config = bd.BlockDiagCPConfig(backend="sdpa_doc", collective_timeout_s=300, ulysses_size=u)
        times, moved, chosen = [], 0, 1
        for it in range(iters + 1):
            # A fresh context per step, as the collator makes (the runtime, agreement included, is per step).
            ctx = bd.BlockDiagCPContext.build(row, cp_rank=rank, cp_size=world, group=dist.group.WORLD, config=config,
                                              heads=HeadShape(HEADS, KV_HEADS, DIM), ulysses_groups=groups)
            q = torch.randn(1, local, HEADS, DIM, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
            k = torch.randn(1, local, KV_HEADS, DIM, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
            v = torch.randn(1, local, KV_HEADS, DIM, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
            dist.barrier()
            t0 = time.perf_counter()
            o, _ = blockdiag_cp_attention(module, q, k, v, None, scaling=DIM ** -0.5, cp_context=ctx)
            o.float().sum().backward()
            dist.barrier()
            if it:  # the first iteration warms up
                times.append(time.perf_counter() - t0)
            moved, chosen = comm_stats(ctx).sent_bytes, ctx.ulysses_size
        out[u] = (chosen, statistics.median(times), moved, min(times), max(times))
    results.put((rank, out))
    bd.training.close_process_groups()


def measure(world: int, full_len: int, iters: int) -> dict:
    """``{ulysses_size: (u chosen, wall ms median, KiB sent, wall ms min, wall ms max)}`` of ``world`` gloo ranks
    (over the timed iterations; each a max over ranks)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, full_len, iters, results)) for r in range(world)]
    for p in procs:
        p.start()
    per_rank = dict(results.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join()
    return {u: (per_rank[0][u][0], max(per_rank[r][u][1] for r in per_rank) * 1e3,
                max(per_rank[r][u][2] for r in per_rank) / 1024, max(per_rank[r][u][3] for r in per_rank) * 1e3,
                max(per_rank[r][u][4] for r in per_rank) * 1e3) for u in _sizes(world)}


def bars_of(rows: dict, world: int) -> list[tuple[int, str, tuple]]:
    """One bar per layout that ran: ``(u, tick label, (chosen, median, KiB, min, max))``. ``auto`` ran one of the
    fixed layouts: it is named under that layout's bar (its own timing is the same layout measured again)."""
    picked = {rows["auto"][0]} if "auto" in rows else set()
    bars = []
    for u, values in rows.items():
        if u == "auto":
            continue
        label = f"u={u} x c={world // u}" + ("\n(auto's choice)" if u in picked else "")
        bars.append((u, label, values))
    return bars


def layout_figure(results: dict, seq_len: int):
    """Two rows of panels, one column per P: wall ms (top) and KiB sent per rank (bottom) per requested
    ``ulysses_size``; each bar in the colour of the ``u`` that ran, ``auto`` hatched."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    worlds = sorted(results)
    fig, axes = plt.subplots(2, len(worlds), figsize=(4.6 * len(worlds), 6.8), squeeze=False)
    for col, world in enumerate(worlds):
        bars = bars_of(results[world], world)
        labels = [label for _, label, _ in bars]
        colors = [U_COLORS[u] for u, _, _ in bars]
        for row, ylabel in enumerate(("wall ms, one layer fwd+bwd", "KiB sent per rank per layer")):
            ax = axes[row][col]
            if row == 0:  # median, whiskers from the fastest to the slowest timed iteration
                heights = [v[1] for _, _, v in bars]
                spread = [[v[1] - v[3] for _, _, v in bars], [v[4] - v[1] for _, _, v in bars]]
                drawn = ax.bar(labels, heights, color=colors, edgecolor="black", linewidth=0.6, yerr=spread,
                               capsize=4)
            else:
                drawn = ax.bar(labels, [v[2] for _, _, v in bars], color=colors, edgecolor="black", linewidth=0.6)
            ax.bar_label(drawn, fmt="%.0f", fontsize=9)
            ax.set_ylabel(ylabel, fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            ax.margins(y=0.15)
            if row == 0:
                ax.set_title(f"P = {world} CP ranks", fontsize=11)
            else:
                ax.set_xlabel("layout (u ranks per head group x c sequence groups)", fontsize=10)
    used = sorted({u for world in worlds for u, _, _ in bars_of(results[world], world)})
    handles = [Patch(facecolor=U_COLORS[u], edgecolor="black", label=f"u = {u}") for u in used]
    fig.suptitle(f"one attention layer on gloo, S = {seq_len}, Hq={HEADS} Hkv={KV_HEADS} D={DIM}, bf16",
                 fontsize=11, y=0.99)
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.955), ncol=len(handles), fontsize=10,
               frameon=False, title="colour: ranks per head-parallel group u; whiskers: min-max over the timed "
               "iterations", title_fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    return fig


def plot(results: dict, seq_len: int, path: str) -> None:
    """Write :func:`layout_figure` to ``path`` (a note instead when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        print(f"\n(matplotlib not installed: no plot; pip install -e '.[bench]' to get {path})")
        return
    layout_figure(results, seq_len).savefig(path, dpi=120)
    print(f"\nplot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096, help="row length S (divisible by every P)")
    parser.add_argument("--iters", type=int, default=5, help="timed fwd+bwd iterations per layout (median, with "
                                                              "min-max whiskers; at least 3)")
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4], help="CP group sizes P (one gloo run each)")
    parser.add_argument("--out", default="bench_layout_wall.png",
                        help="PNG of the table (needs matplotlib: pip install -e '.[bench]')")
    args = parser.parse_args()
    if args.iters < 3:
        parser.error(f"--iters {args.iters}: give at least 3 (the plot shows the spread)")
    print(f"## One layer fwd+bwd on gloo per layout (S={args.seq_len}, Hq={HEADS}, Hkv={KV_HEADS}, D={DIM}, bf16, "
          f"sdpa_doc, 1 thread per rank, median of {args.iters}, max over ranks)\n")
    print("| P | ulysses_size | u x c | wall ms (fwd+bwd, median) | min-max ms | KiB sent per rank (max) |")
    print("|---|---|---|---:|---:|---:|")
    results = {}
    for world in args.cp_sizes:
        results[world] = measure(world, args.seq_len, args.iters)
        for u, (chosen, wall, sent, fastest, slowest) in results[world].items():
            print(f"| {world} | {u} | {chosen} x {world // chosen} | {wall:.1f} | {fastest:.1f}-{slowest:.1f} | "
                  f"{sent:.0f} |")
    plot(results, args.seq_len, args.out)


if __name__ == "__main__":
    main()
