"""K/V exchange: tokens each CP rank receives per layer, and wall time per strategy on gloo.

Part 1 (host simulation, no processes): for P = 2, 4, 8 and packed rows of lognormal document
lengths with mean S/8, the K/V tokens every rank receives under each strategy, as mean and max over
ranks and seeds, against all-gather.

Part 2 (real gloo processes on this machine): wall time of one layer's exchange forward+backward and
of the whole CP attention layer (exchange + sdpa_doc kernel) per strategy, at P = 2 and 4.

Part 3 (``--gathers``, real gloo processes): CPU and wall time per call of the package's fixed-shape all-gather
(the recurrent state summaries' gather, ``distributed/exchange.all_gather``) and of its backward, with the backward as
direct sends to every peer (what the package runs on gloo) and as gloo's reduce-scatter, at P = 2 and 4 (the forward
is gloo's all-gather in both).

    python benchmarks/bench_exchange.py                 # parts 1 and 2
    python benchmarks/bench_exchange.py --no-timing     # simulation only
    python benchmarks/bench_exchange.py --no-timing --gathers
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hf_blockdiag_cp import BlockDiagCPConfig  # noqa: E402
from hf_blockdiag_cp.planning.exchange import plan_exchange  # noqa: E402
from hf_blockdiag_cp.training import close_process_groups  # noqa: E402


def lognormal_row(full_len: int, mean: float, sigma: float, gen: torch.Generator) -> torch.Tensor:
    """Document ids of one row packed to exactly ``full_len`` tokens with lognormal lengths."""
    mu = torch.log(torch.tensor(mean)) - sigma ** 2 / 2  # so that E[length] = mean
    ids, used, doc = [], 0, 1
    while used < full_len:
        n = int(torch.exp(mu + sigma * torch.randn((), generator=gen)).round().clamp(min=1))
        n = min(n, full_len - used)
        ids.append(torch.full((n,), doc))
        used += n
        doc += 1
    return torch.cat(ids)


def simulate(cp_sizes: list[int], full_len: int, seeds: int, sigma: float) -> None:
    print(f"\n## Tokens received per rank per layer (S={full_len}, lognormal docs mean S/8, sigma={sigma}, "
          f"{seeds} seeds)\n")
    print("| P | strategy | mean recv | max recv | all-gather | mean / all-gather | max / all-gather | "
          "halo valid | auto picks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for cp_size in cp_sizes:
        rows = [lognormal_row(full_len, full_len / 8, sigma, torch.Generator().manual_seed(s)) for s in range(seeds)]
        allgather = (cp_size - 1) * (full_len // cp_size)
        for strategy in ("auto", "halo", "a2a"):
            received, halo_ok, picks = [], 0, {}
            for row in rows:
                with warnings.catch_warnings():  # "halo cannot serve ..." is the point of this table
                    warnings.simplefilter("ignore")
                    plan = plan_exchange(row, cp_size=cp_size, config=BlockDiagCPConfig(kv_exchange=strategy))
                received += [plan.rows_received(r) for r in range(cp_size)]
                halo_ok += plan.halo_valid
                picks[plan.strategy] = picks.get(plan.strategy, 0) + 1
            mean, peak = statistics.fmean(received), max(received)
            pick = ", ".join(f"{k} {v}" for k, v in sorted(picks.items()))
            print(f"| {cp_size} | {strategy} | {mean:.0f} | {peak} | {allgather} | {mean / allgather:.3f} | "
                  f"{peak / allgather:.3f} | {halo_ok}/{seeds} | {pick} |")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timing_worker(rank: int, world: int, port: int, full_len: int, iters: int, results) -> None:
    import torch.distributed as dist

    from hf_blockdiag_cp import BlockDiagCPContext
    from hf_blockdiag_cp.attention.cp import sequence_attention
    from hf_blockdiag_cp.attention.layer import kv_exchange
    from hf_blockdiag_cp.distributed.exchange import exchange_kv

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    heads, kv_heads, dim = 8, 2, 64
    local = full_len // world
    row = lognormal_row(full_len, full_len / 8, 1.0, torch.Generator().manual_seed(0))
    out = {}
    warnings.simplefilter("ignore")
    for strategy in ("allgather", "halo", "a2a", "auto"):
        config = BlockDiagCPConfig(kv_exchange=strategy, backend="sdpa_doc")
        ctx = BlockDiagCPContext.build(row, cp_rank=rank, cp_size=world, group=dist.group.WORLD, config=config)
        q = torch.randn(1, local, heads, dim, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        k = torch.randn(1, local, kv_heads, dim, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        v = torch.randn(1, local, kv_heads, dim, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        kv = torch.randn(local, kv_heads * dim * 2, dtype=torch.bfloat16, requires_grad=True)
        ex = kv_exchange(ctx, torch.device("cpu"))
        times = {"exchange": [], "layer": []}
        for it in range(iters + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if ex is not None:
                exchange_kv(kv, ex).sum().backward()
            dist.barrier()
            t1 = time.perf_counter()
            o = sequence_attention(ctx, q, k, v, dropout_p=0.0, scale=dim ** -0.5, window=None, softcap=None)
            o.float().sum().backward()
            dist.barrier()
            t2 = time.perf_counter()
            if it:  # the first iteration warms up (and runs the rank agreement)
                times["exchange"].append(t1 - t0)
                times["layer"].append(t2 - t1)
        out[strategy] = (ctx.exchange.strategy, statistics.median(times["exchange"]), statistics.median(times["layer"]),
                         ctx.exchange.rows_received(rank))
    results.put((rank, out))
    close_process_groups()


def timing(cp_sizes: list[int], full_len: int, iters: int) -> None:
    import torch.multiprocessing as mp

    print(f"\n## Wall time per layer on gloo (S={full_len}, Hq=8, Hkv=2, D=64, bf16, 1 thread per rank, "
          f"median of {iters}; max over ranks)\n")
    print("| P | strategy | resolved | exchange fwd+bwd (ms) | attention layer fwd+bwd (ms) | max tokens received |")
    print("|---|---|---|---|---|---|")
    ctx = mp.get_context("spawn")
    for world in cp_sizes:
        results = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_timing_worker, args=(r, world, port, full_len, iters, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        per_rank = dict(results.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
        for strategy in ("allgather", "halo", "a2a", "auto"):
            resolved = per_rank[0][strategy][0]
            ex = max(per_rank[r][strategy][1] for r in per_rank) * 1e3
            layer = max(per_rank[r][strategy][2] for r in per_rank) * 1e3
            recv = max(per_rank[r][strategy][3] for r in per_rank)
            print(f"| {world} | {strategy} | {resolved} | {ex:.1f} | {layer:.1f} | {recv} |")


def _gather_worker(rank: int, world: int, store: str, calls: int, rows: int, width: int, out: str) -> None:
    import json

    import torch.distributed as dist

    from hf_blockdiag_cp.distributed import exchange

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    on = exchange.GatherGroup(world, rank, dist.group.WORLD, datetime.timedelta(seconds=120), None,
                              tuple(range(world)))
    direct = exchange._direct
    times = {}
    for path in ("direct backward", "gloo reduce-scatter"):
        exchange._direct = direct if path == "direct backward" else (lambda ex: False)
        buf = torch.randn(rows, width, requires_grad=True)
        for phase in ("forward", "backward"):
            for i in range(calls + 5):  # 5 warm-up calls
                if i == 5:
                    dist.barrier()
                    cpu, wall = time.process_time(), time.perf_counter()
                gathered = exchange.all_gather(buf, on, "benchmark all-gather")
                if phase == "backward":
                    gathered.backward(torch.ones_like(gathered))
            # the backward phase times forward + backward; the forward phase is subtracted below
            times[path, phase] = ((time.process_time() - cpu) / calls, (time.perf_counter() - wall) / calls)
        times[path, "backward"] = tuple(b - f for b, f in zip(times[path, "backward"], times[path, "forward"]))
    exchange._direct = direct
    with open(f"{out}.{rank}", "w") as f:
        json.dump({f"{p}|{q}": v for (p, q), v in times.items()}, f)
    close_process_groups()


def gathers(cp_sizes: list[int], calls: int, rows: int = 2, width: int = 2000) -> None:
    import json
    import tempfile

    import torch.multiprocessing as mp

    print(f"\n## The fixed-shape all-gather on gloo ([{rows}, {width}] fp32 per rank, {calls} calls, 1 thread per rank;"
          " CPU: the busiest rank's process time per call, wall: the slowest rank's)\n")
    print("| P | backward | forward CPU / wall (ms) | backward CPU / wall (ms) |")
    print("|---|---|---|---|")
    for world in cp_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(_gather_worker, args=(world, f"{tmp}/store", calls, rows, width, f"{tmp}/t"),
                               nprocs=world, start_method="spawn")
            per_rank = []
            for r in range(world):
                with open(f"{tmp}/t.{r}") as f:
                    per_rank.append(json.load(f))
        for path in ("direct backward", "gloo reduce-scatter"):
            cells = []
            for phase in ("forward", "backward"):
                cpu = max(t[f"{path}|{phase}"][0] for t in per_rank) * 1e3
                wall = max(t[f"{path}|{phase}"][1] for t in per_rank) * 1e3
                cells.append(f"{cpu:.2f} / {wall:.2f}")
            print(f"| {world} | {path} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=16384, help="row length S of the simulation (part 1)")
    parser.add_argument("--seeds", type=int, default=200, help="rows simulated per CP size")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the document lengths")
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4, 8], help="CP sizes P simulated")
    parser.add_argument("--timing-cp-sizes", type=int, nargs="+", default=[2, 4],
                        help="CP sizes timed on gloo (part 2; one process per rank)")
    parser.add_argument("--timing-seq-len", type=int, default=8192, help="row length S of the timing")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per strategy (median reported)")
    parser.add_argument("--no-timing", action="store_true", help="skip part 2 (the gloo timing)")
    parser.add_argument("--gathers", action="store_true",
                        help="part 3: the fixed-shape all-gather on gloo; backward: direct sends vs reduce-scatter")
    parser.add_argument("--calls", type=int, default=200, help="part 3: timed calls per path and phase")
    args = parser.parse_args()
    simulate(args.cp_sizes, args.seq_len, args.seeds, args.sigma)
    if not args.no_timing:
        timing(args.timing_cp_sizes, args.timing_seq_len, args.iters)
    if args.gathers:
        gathers(args.timing_cp_sizes, args.calls)


if __name__ == "__main__":
    main()
