"""Wall time of one attention layer's forward+backward per ``u x c`` layout, on real gloo processes.

For P = 2 and 4 CP ranks on this machine (CPU, one thread per rank, bf16, ``sdpa_doc`` kernel), a
packed row of lognormal document lengths (mean S/8), heads Hq=8, Hkv=2, D=64: every valid
``ulysses_size`` and ``auto``, through the registered ``blockdiag_cp`` attention function (agreement,
head all-to-all, K/V exchange, kernel, all-to-all back), median over iterations, max over ranks; with
the bytes each rank moved per layer (forward + backward, counted).

    python benchmarks/bench_layout_wall.py [--seq-len 4096] [--iters 3] [--cp-sizes 2 4]
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


def _sizes(world: int) -> list:
    from hf_blockdiag_cp.planning.layout import HeadShape, valid_ulysses_sizes

    return [*valid_ulysses_sizes(world, HeadShape(HEADS, KV_HEADS, DIM)), "auto"]


def _worker(rank: int, world: int, port: int, full_len: int, iters: int, results) -> None:
    import torch.distributed as dist

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.attention import blockdiag_cp_attention
    from hf_blockdiag_cp.attention.cp import comm_stats
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
        out[u] = (chosen, statistics.median(times), moved)
    results.put((rank, out))
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096, help="row length S (divisible by every P)")
    parser.add_argument("--iters", type=int, default=3, help="timed fwd+bwd iterations per layout (median)")
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4], help="CP group sizes P (one gloo run each)")
    args = parser.parse_args()
    print(f"## One layer fwd+bwd on gloo per layout (S={args.seq_len}, Hq={HEADS}, Hkv={KV_HEADS}, D={DIM}, bf16, "
          f"sdpa_doc, 1 thread per rank, median of {args.iters}, max over ranks)\n")
    print("| P | ulysses_size | u x c | wall ms (fwd+bwd) | KiB sent per rank (max) |")
    print("|---|---|---|---:|---:|")
    ctx = mp.get_context("spawn")
    for world in args.cp_sizes:
        results = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, args.seq_len, args.iters, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        per_rank = dict(results.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
        for u in _sizes(world):
            chosen = per_rank[0][u][0]
            wall = max(per_rank[r][u][1] for r in per_rank) * 1e3
            sent = max(per_rank[r][u][2] for r in per_rank) / 1024
            print(f"| {world} | {u} | {chosen} x {world // chosen} | {wall:.1f} | {sent:.0f} |")


if __name__ == "__main__":
    main()
