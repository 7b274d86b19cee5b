"""Load balance of CP placements: attention work per rank against the K/V each rank must receive.

Part 1 (host simulation, no processes): for P = 2, 4, 8 and packed rows drawn from several document
length distributions, every placement's imbalance (max / mean causal query-key pairs over ranks, the
work model of ``planning/placement.py``), the remote K/V rows each rank needs (exact need as a
fraction of S: mean and max over ranks) and the planner's host time per step.

Part 2 (real gloo processes, tiny Llama): per-rank attention kernel CPU time (thread time, so that
oversubscribed cores do not blur it) as max / mean over ranks, contiguous vs balanced, next to the
simulated imbalance of the same rows; and the step wall time at P = 2.

    python benchmarks/bench_balance.py                      # both parts, 100 seeds
    python benchmarks/bench_balance.py --no-measure         # simulation only
    python benchmarks/bench_balance.py --out bench_balance.png
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hf_blockdiag_cp.planning.documents import document_spans  # noqa: E402
from hf_blockdiag_cp.planning.exchange import plan_exchange  # noqa: E402
from hf_blockdiag_cp.planning.placement import Placement, make_placement, rank_work  # noqa: E402
from hf_blockdiag_cp.training import close_process_groups  # noqa: E402

SCHEMES = ("contiguous", "zigzag", "headtail", "balanced")


# --- rows -------------------------------------------------------------------------------------------

def _pack(lengths: Callable[[], int], full_len: int) -> torch.Tensor:
    """Document ids of one row filled to exactly ``full_len`` tokens with lengths drawn from ``lengths``."""
    ids, used, doc = [], 0, 1
    while used < full_len:
        n = min(max(1, lengths()), full_len - used)
        ids.append(torch.full((n,), doc))
        used += n
        doc += 1
    return torch.cat(ids)


def _lognormal(mean: float, sigma: float, gen: torch.Generator) -> Callable[[], int]:
    mu = math.log(mean) - sigma ** 2 / 2  # so that E[length] = mean
    return lambda: int(round(math.exp(mu + sigma * float(torch.randn((), generator=gen)))))


def make_row(kind: str, full_len: int, seed: int) -> torch.Tensor:
    """One packed row: ``lognormal_8`` / ``lognormal_32`` (mean S/8, S/32, sigma 1), ``one_doc``, or
    ``heavy_tail`` (a mix: 80% of documents lognormal mean S/64, 20% mean S/4, sigma 1.5)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "one_doc":
        return torch.ones(full_len, dtype=torch.int64)
    if kind.startswith("lognormal_"):
        return _pack(_lognormal(full_len / int(kind.split("_")[1]), 1.0, gen), full_len)
    if kind == "heavy_tail":
        short, long = _lognormal(full_len / 64, 1.5, gen), _lognormal(full_len / 4, 1.5, gen)
        return _pack(lambda: long() if float(torch.rand((), generator=gen)) < 0.2 else short(), full_len)
    raise ValueError(kind)


ROWS = ("lognormal_8", "lognormal_32", "one_doc", "heavy_tail")


# --- placements -------------------------------------------------------------------------------------

def headtail_placement(row: torch.Tensor, cp_size: int) -> Placement:
    """Every document split head-tail over all ranks (chunks ``j`` and ``2P-1-j`` of ``2P`` to rank
    ``j``); ranks then trade a few positions so that each holds exactly ``L`` (the baseline that
    balances perfectly and needs almost an all-gather)."""
    full_len = row.numel()
    owner = torch.full((full_len,), -1, dtype=torch.int64)
    for start, end in document_spans(row):
        bounds = [start + ((end - start) * i) // (2 * cp_size) for i in range(2 * cp_size + 1)]
        for j in range(cp_size):
            owner[bounds[j]:bounds[j + 1]] = j
            owner[bounds[2 * cp_size - 1 - j]:bounds[2 * cp_size - j]] = j
    local_len = full_len // cp_size
    free = torch.nonzero(owner < 0).flatten().tolist()
    counts = torch.bincount(owner[owner >= 0], minlength=cp_size).tolist()
    for rank in range(cp_size):  # over-full ranks give away their last positions
        extra = counts[rank] - local_len
        if extra > 0:
            mine = torch.nonzero(owner == rank).flatten()[-extra:]
            owner[mine] = -1
            free.extend(mine.tolist())
            counts[rank] = local_len
    for rank in range(cp_size):
        need = local_len - counts[rank]
        owner[torch.tensor(free[:need], dtype=torch.int64)] = rank
        free = free[need:]
    return Placement.from_owner("headtail", owner, cp_size)


def place(row: torch.Tensor, cp_size: int, scheme: str) -> Placement:
    if scheme == "headtail":
        return headtail_placement(row, cp_size)
    return make_placement(row, cp_size, scheme)


def evaluate(row: torch.Tensor, cp_size: int, scheme: str) -> dict[str, float]:
    """Imbalance, remote K/V (fraction of S, mean and max over ranks) and planner time of one row."""
    start = time.perf_counter()
    placement = place(row, cp_size, scheme)
    plan_ms = (time.perf_counter() - start) * 1e3
    work = rank_work(row, placement)
    exchange = plan_exchange(row, cp_size=cp_size, placement=placement)
    remote = [exchange.remote_rows(r) / row.numel() for r in range(cp_size)]
    return {"imbalance": float(work.max() / work.mean()), "remote_mean": statistics.mean(remote),
            "remote_max": max(remote), "plan_ms": plan_ms}


def summarize(kind: str, cp_size: int, scheme: str, seeds: range, full_len: int) -> dict[str, float]:
    """Mean and p90 imbalance, mean / max remote K/V, mean planner time over ``seeds``."""
    runs = [evaluate(make_row(kind, full_len, seed), cp_size, scheme) for seed in seeds]
    imbalance = sorted(r["imbalance"] for r in runs)
    return {
        "imbalance_mean": statistics.mean(imbalance),
        "imbalance_p90": imbalance[min(len(imbalance) - 1, int(0.9 * len(imbalance)))],
        "remote_mean": statistics.mean(r["remote_mean"] for r in runs),
        "remote_max": max(r["remote_max"] for r in runs),
        "plan_ms": statistics.mean(r["plan_ms"] for r in runs),
    }


def simulate(cp_sizes: list[int], full_len: int, seeds: int) -> dict[tuple[str, int, str], dict[str, float]]:
    print(f"\n## Placement balance and traffic (S={full_len}, {seeds} seeds per row kind)\n")
    print("| rows | P | placement | imbalance mean | imbalance p90 | remote K/V mean (× S) | remote K/V max (× S) "
          "| planner ms |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    results = {}
    for kind in ROWS:
        for cp_size in cp_sizes:
            for scheme in SCHEMES:
                n = 1 if kind == "one_doc" else seeds
                r = summarize(kind, cp_size, scheme, range(n), full_len)
                results[(kind, cp_size, scheme)] = r
                print(f"| {kind} | {cp_size} | {scheme} | {r['imbalance_mean']:.3f} | {r['imbalance_p90']:.3f} | "
                      f"{r['remote_mean']:.3f} | {r['remote_max']:.3f} | {r['plan_ms']:.2f} |", flush=True)
    return results


def planner_time(full_len: int = 131072, num_docs: int = 1000, cp_size: int = 8, repeats: int = 20) -> float:
    """Median host time (ms) of the balanced placement plus the exchange plan for one step."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.distributions.LogNormal(0.0, 1.0).sample((num_docs,))
    lengths = (lengths / lengths.sum() * full_len).long().clamp(min=1)
    row = torch.repeat_interleave(torch.arange(1, num_docs + 1), lengths)[:full_len]
    row = torch.cat([row, torch.zeros(full_len - row.numel(), dtype=torch.int64)])
    del gen
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        make_placement(row, cp_size, "balanced")
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# --- real gloo measurement --------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _measure_worker(rank: int, world: int, port: int, full_len: int, seeds: list[int], steps: int, results) -> None:
    import datetime

    import torch.distributed as dist
    import transformers

    import hf_blockdiag_cp as bd
    import hf_blockdiag_cp.kernels.sdpa_doc as sdpa_doc

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    spent = [0.0]
    kernel = sdpa_doc.attention

    def timed(*args, **kwargs):  # thread CPU time of the kernel only (not the exchange's waits)
        start = time.thread_time()
        out = kernel(*args, **kwargs)
        spent[0] += time.thread_time() - start
        return out

    sdpa_doc.attention = timed
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=full_len)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.set_attn_implementation("blockdiag_cp")
    out = {}
    for seed in seeds:
        row = make_row("lognormal_8", full_len, seed)
        docs = [{"input_ids": torch.randint(1, 97, (b - a,), generator=torch.Generator().manual_seed(a)).tolist()}
                for a, b in document_spans(row)]
        for placement in ("contiguous", "balanced"):
            collator = bd.PackingCollator(full_len, group=dist.group.WORLD, pad_token_id=0, placement=placement,
                                          config=bd.BlockDiagCPConfig(backend="sdpa_doc"))
            batch = collator(docs)
            simulated = rank_work(batch["cp_context"].doc_ids[0], batch["cp_context"].placement)
            times, walls = [], []
            for step in range(steps + 1):
                spent[0] = 0.0
                dist.barrier()
                start = time.perf_counter()
                model(**collator(docs)).loss.backward()
                dist.barrier()
                if step:  # the first step warms up
                    times.append(spent[0])
                    walls.append(time.perf_counter() - start)
            out[(seed, placement)] = (statistics.median(times), statistics.median(walls),
                                      float(simulated.max() / simulated.mean()))
    results.put((rank, out))
    close_process_groups()


def measure(cp_size: int, full_len: int, seeds: list[int], steps: int) -> dict:
    """Per-rank kernel thread time max / mean and step wall time, per (seed, placement)."""
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_measure_worker, args=(r, cp_size, port, full_len, seeds, steps, results))
             for r in range(cp_size)]
    for p in procs:
        p.start()
    per_rank = dict(results.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    table = {}
    for key in per_rank[0]:
        times = [per_rank[r][key][0] for r in range(cp_size)]
        table[key] = {"measured": max(times) / statistics.mean(times), "simulated": per_rank[0][key][2],
                      "wall_s": max(per_rank[r][key][1] for r in range(cp_size)), "kernel_s": max(times)}
    return table


def report_measurements(cp_sizes: list[int], full_len: int, seeds: list[int], steps: int) -> dict:
    print(f"\n## Measured on gloo (tiny Llama, S={full_len}, lognormal mean S/8, seeds {seeds}, median of "
          f"{steps} steps)\n")
    print("| P | seed | placement | attention CPU max/mean (measured) | simulated imbalance | |measured - simulated| "
          "| slowest rank's attention CPU s | step wall s |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    tables = {}
    for cp_size in cp_sizes:
        table = measure(cp_size, full_len, seeds, steps)
        tables[cp_size] = table
        for (seed, placement), r in sorted(table.items()):
            print(f"| {cp_size} | {seed} | {placement} | {r['measured']:.3f} | {r['simulated']:.3f} | "
                  f"{abs(r['measured'] - r['simulated']):.3f} | {r['kernel_s']:.3f} | {r['wall_s']:.2f} |",
                  flush=True)
    return tables


#: Panel titles of the row kinds (see :func:`make_row`).
ROW_TITLES = {"lognormal_8": "lognormal documents, mean S/8", "lognormal_32": "lognormal documents, mean S/32",
              "one_doc": "one document filling the row", "heavy_tail": "heavy tail: 80% S/64, 20% S/4"}
#: One colour per placement, one marker per CP size: what the legend says.
COLORS = {"contiguous": "tab:red", "zigzag": "tab:orange", "headtail": "tab:purple", "balanced": "tab:green"}
MARKERS = ("o", "s", "^", "D", "v", "P")


def balance_figure(results: dict):
    """One panel per row kind: remote K/V per rank (x) against imbalance (y), a colour per placement and a
    marker per CP size ``P`` (points drawn in ``sorted(results)`` order)."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    cp_sizes = sorted({cp_size for _, cp_size, _ in results})
    marker = {cp_size: MARKERS[i % len(MARKERS)] for i, cp_size in enumerate(cp_sizes)}
    fig, axes = plt.subplots(1, len(ROWS), figsize=(4.2 * len(ROWS), 4.4), sharey=True)
    for ax, kind in zip(axes, ROWS):
        for (k, cp_size, scheme), r in sorted(results.items()):
            if k == kind:
                ax.scatter(r["remote_mean"], r["imbalance_mean"], color=COLORS[scheme], marker=marker[cp_size],
                           s=70, edgecolors="black", linewidths=0.5, alpha=0.9)
        ax.set_title(ROW_TITLES.get(kind, kind), fontsize=11)
        ax.set_xlabel("remote K/V per rank (fraction of S, mean)", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("attention work: max / mean over ranks", fontsize=10)
    placements = [Line2D([], [], color=COLORS[s], marker="o", linestyle="", markersize=9, label=s) for s in SCHEMES]
    sizes = [Line2D([], [], color="grey", marker=marker[p], linestyle="", markersize=9, label=f"P = {p}")
             for p in cp_sizes]
    fig.legend(handles=placements + sizes, loc="upper center", ncol=len(placements) + len(sizes), fontsize=10,
               frameon=False, title="colour: placement; marker: CP size P", title_fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.86))
    return fig


def plot(results: dict, path: str) -> None:
    """Write :func:`balance_figure` to ``path`` (a note instead when matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        print(f"\n(matplotlib not installed: no plot; pip install -e '.[bench]' to get {path})")
        return
    balance_figure(results).savefig(path, dpi=120)
    print(f"\nplot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4, 8], help="CP sizes P simulated (part 1)")
    parser.add_argument("--seq-len", type=int, default=16384, help="row length S of the simulation")
    parser.add_argument("--seeds", type=int, default=100, help="rows simulated per row kind and P")
    parser.add_argument("--no-measure", action="store_true", help="skip part 2 (the gloo measurement)")
    parser.add_argument("--measure-seq-len", type=int, default=16384, help="row length S of the measurement")
    parser.add_argument("--measure-cp-sizes", type=int, nargs="+", default=[2, 4],
                        help="CP sizes measured (one gloo process per rank)")
    parser.add_argument("--measure-seeds", type=int, nargs="+", default=[0, 1, 2], help="row seeds measured")
    parser.add_argument("--steps", type=int, default=3, help="training steps per measured row (median reported)")
    parser.add_argument("--out", default="bench_balance.png",
                        help="PNG of the simulation (needs matplotlib: pip install -e '.[bench]')")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = simulate(args.cp_sizes, args.seq_len, args.seeds)
    print(f"\nplanner (balanced placement, S=131072, 1000 documents, P=8): {planner_time():.2f} ms per step "
          "(median of 20, one thread)")
    plot(results, args.out)
    if not args.no_measure:
        report_measurements(args.measure_cp_sizes, args.measure_seq_len, args.measure_seeds, args.steps)


if __name__ == "__main__":
    main()
