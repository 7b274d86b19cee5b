"""Bytes per recurrent layer per CP rank: state passing vs the head-parallel fallback, measured and by formula.

Part 1 (real gloo processes): one forward of tiny recurrent-only models (qwen3_next with two gated-delta-rule layers,
2 key / 4 value heads; bamba: two Mamba2/SSD layers, no attention) on a packed row of lognormal documents (mean
S/8), P = 2 and 4, ``recurrent_layout="state"`` and ``"heads"``. Measured: the bytes this rank sent in the forward
(``comm_stats``: every collective of these models is a recurrent one), per layer, max over ranks. Formula:
``(P - 1) * slots * W * 4`` per served call for state passing (docs/layouts.md, ``recurrent/state_passing.py``),
:func:`~hf_blockdiag_cp.recurrent.head_parallel.head_parallel_bytes` for the fallback. Two row lengths show that
state passing does not grow with the row and the fallback does.

Part 2 (arithmetic): the same formulas for Qwen3-Next-80B-A3B (36 gated-delta-rule layers of 48) and
Nemotron-H-8B (24 Mamba2 layers of 52) at S = 128K tokens on P = 8 ranks, bf16 activations, with ``slots`` read
off the fragment plan of a lognormal row (mean S/8) under each placement.

    python benchmarks/bench_recurrent_bytes.py               # both parts
    python benchmarks/bench_recurrent_bytes.py --no-measure  # arithmetic only

Part 3 (``--placements``, arithmetic): attention imbalance vs recurrent bytes per layer per rank of every placement
(balanced, the hybrid-aware ``hybrid+k`` of ``planning/hybrid_placement.py``, contiguous, zigzag, the mirror placement
of ``planning/mirror_placement.py``, and what the cost model chooses) on the rows of ``bench_balance.py`` (lognormal
mean S/8 and S/32, heavy-tailed mix), at 128K / 8 and 1M / 64 ranks with Qwen3-Next-80B-A3B and Nemotron-H-8B sizes,
and the host time of the choice (all candidates) and of the mirror placement alone; ``--plot`` saves the scatter if
matplotlib imports.

    python benchmarks/bench_recurrent_bytes.py --no-measure --placements --seeds 3 --plot placements.png
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

from hf_blockdiag_cp.planning.fragments import plan_fragments  # noqa: E402
from hf_blockdiag_cp.planning.placement import make_placement  # noqa: E402
from hf_blockdiag_cp.recurrent.head_parallel import head_parallel_bytes  # noqa: E402
from hf_blockdiag_cp.training import close_process_groups  # noqa: E402

MIB = 2 ** 20


def lognormal_lengths(full_len: int, mean: float, gen: torch.Generator, sigma: float = 1.0) -> list[int]:
    """Document lengths filling exactly ``full_len`` tokens, lognormal with mean ``mean``."""
    mu = torch.log(torch.tensor(mean)) - sigma ** 2 / 2
    lengths, used = [], 0
    while used < full_len:
        n = int(torch.exp(mu + sigma * torch.randn((), generator=gen)).round().clamp(min=1))
        n = min(n, full_len - used)
        lengths.append(n)
        used += n
    return lengths


def row_ids(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)])[None]


# ---- formulas per mixer (one layer: its causal convolution and its scan) ---------------------------------------


def gdn_state(p: int, slots: int, hk: int, hv: int, dk: int, dv: int, kernel: int) -> int:
    """State passing, one gated-delta-rule layer: conv ``W = C (K - 1)`` and scan ``W = Hv Dk Dv + Hv Dk Dk``."""
    channels = 2 * hk * dk + hv * dv
    return (p - 1) * slots * 4 * (channels * (kernel - 1) + hv * dk * dv + hv * dk * dk)


def gdn_heads(local: int, p: int, hk: int, hv: int, dk: int, dv: int, e: int) -> int:
    """Head-parallel fallback, one gated-delta-rule layer: conv channels in/out; value, g (fp32), beta, output by
    value head; query and key by key head."""
    channels = 2 * hk * dk + hv * dv
    conv = head_parallel_bytes(local, p, [(channels, 1, e)], [], (channels, 1, e))
    scan = head_parallel_bytes(local, p, [(hv, dv, e), (hv, 1, 4), (hv, 1, e)], [(hk, dk, e), (hk, dk, e)],
                               (hv, dv, e))
    return conv + scan


def ssd_state(p: int, slots: int, h: int, hd: int, g: int, n: int, kernel: int) -> int:
    """State passing, one Mamba2 layer: conv ``W = C (K - 1)`` (``C = H P + 2 G N``) and scan ``W = H P N + H``."""
    channels = h * hd + 2 * g * n
    return (p - 1) * slots * 4 * (channels * (kernel - 1) + h * hd * n + h)


def ssd_heads(local: int, p: int, h: int, hd: int, g: int, n: int, e: int) -> int:
    """Head-parallel fallback, one Mamba2 layer: conv channels in/out; x, dt and y by head; B and C by group."""
    channels = h * hd + 2 * g * n
    conv = head_parallel_bytes(local, p, [(channels, 1, e)], [], (channels, 1, e))
    scan = head_parallel_bytes(local, p, [(h, hd, e), (h, 1, e)], [(g, n, e), (g, n, e)], (h, hd, e))
    return conv + scan


# ---- part 1: measured on gloo ----------------------------------------------------------------------------------

MODELS = ("qwen3_next", "bamba")


def _config(kind: str):
    from hf_blockdiag_cp.conformance.configs import tiny_config

    config = tiny_config(kind)
    if kind == "qwen3_next":  # recurrent layers only: every collective is a recurrent one
        config.layer_types = ["linear_attention", "linear_attention"]
        config.linear_num_key_heads = 2
    return config


def _formula(kind: str, config, layout: str, local: int, p: int, slots: int) -> int:
    """Bytes per layer of the tiny model (fp32) by formula."""
    if kind == "qwen3_next":
        dims = (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                config.linear_value_head_dim)
        if layout == "state":
            return gdn_state(p, slots, *dims, config.linear_conv_kernel_dim)
        return gdn_heads(local, p, *dims, 4)
    dims = (config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups, config.mamba_d_state)
    if layout == "state":
        return ssd_state(p, slots, *dims, config.mamba_d_conv)
    return ssd_heads(local, p, *dims, 4)


def _worker(rank: int, world: int, port: int, lengths_by_len: dict, results) -> None:
    import torch.distributed as dist

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp import comm_stats
    from hf_blockdiag_cp.conformance.runs import build_model
    from hf_blockdiag_cp.recurrent.runs import _cached_plan

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    out = {}
    for kind in MODELS:
        config = _config(kind)
        model = build_model(config, "blockdiag_cp").eval()
        layers = config.num_hidden_layers
        for full_len, lengths in lengths_by_len.items():
            gen = torch.Generator().manual_seed(1)
            examples = [{"input_ids": torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()}
                        for n in lengths]
            for layout in ("state", "heads"):
                collator = bd.PackingCollator(full_len, group=dist.group.WORLD, pad_token_id=0,
                                              config=bd.BlockDiagCPConfig(recurrent_layout=layout,
                                                                          collective_timeout_s=600))
                batch = collator(examples)
                ctx = batch["cp_context"]
                with torch.no_grad():
                    model(**batch)
                sent = sum(s for phase, s, _ in comm_stats(ctx).per_call if phase == "forward")
                slots = _cached_plan(ctx).slots
                out[(kind, full_len, layout)] = (sent // layers, _formula(kind, config, layout, ctx.local_len, world,
                                                                          slots), slots)
    results.put((rank, out))
    close_process_groups()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(cp_sizes: list[int], lengths: list[int]) -> None:
    import torch.multiprocessing as mp

    rows = {n: lognormal_lengths(n, n / 8, torch.Generator().manual_seed(0)) for n in lengths}
    print("\n## Measured bytes per recurrent layer per rank, one forward (tiny fp32 models, gloo, balanced "
          "placement; max over ranks)\n")
    print("| model | P | S | layout | slots | measured (B) | formula (B) | equal |")
    print("|---|---|---|---|---|---|---|---|")
    ctx = mp.get_context("spawn")
    for world in cp_sizes:
        results = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, world, port, rows, results)) for r in range(world)]
        for p in procs:
            p.start()
        per_rank = dict(results.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join()
        for key in per_rank[0]:
            kind, full_len, layout = key
            measured = max(per_rank[r][key][0] for r in per_rank)
            formula = max(per_rank[r][key][1] for r in per_rank)
            equal = all(per_rank[r][key][0] == per_rank[r][key][1] for r in per_rank)
            print(f"| {kind} | {world} | {full_len} | {layout} | {per_rank[0][key][2]} | {measured} | {formula} | "
                  f"{'yes' if equal else 'NO'} |")


# ---- part 2: arithmetic for real models ----------------------------------------------------------------------

#: (name, kind, recurrent layers, dims) read from the models' published configs (Hugging Face config.json).
REAL = (
    ("Qwen3-Next-80B-A3B", "gdn", 36, dict(hk=16, hv=32, dk=128, dv=128, kernel=4)),
    ("Nemotron-H-8B", "ssd", 24, dict(h=128, hd=64, g=8, n=128, kernel=4)),
)


def arithmetic(full_len: int, p: int, seeds: int) -> None:
    local = full_len // p
    slots: dict[str, list[int]] = {}
    for kind in ("contiguous", "zigzag", "balanced", "mirror"):
        slots[kind] = []
        for seed in range(seeds):
            ids = row_ids(lognormal_lengths(full_len, full_len / 8, torch.Generator().manual_seed(seed)))
            slots[kind].append(plan_fragments(ids, make_placement(ids[0], p, kind).index).slots)
    print(f"\n## Real models at S = {full_len} tokens on P = {p} ranks (L = {local} per rank), bf16 activations, "
          f"per recurrent layer per rank, forward (backward moves the same again); rows of lognormal documents "
          f"(mean S/8, {seeds} seeds)\n")
    print("| model | recurrent layers | layout | slots (mean / max over rows) | per layer (MiB, at max slots) | "
          "whole model fwd (GiB) |")
    print("|---|---|---|---|---|---|")
    for name, kind, layers, dims in REAL:
        if kind == "gdn":
            args = (dims["hk"], dims["hv"], dims["dk"], dims["dv"])
            state = lambda s: gdn_state(p, s, *args, dims["kernel"])  # noqa: E731
            heads = gdn_heads(local, p, *args, 2)
        else:
            args = (dims["h"], dims["hd"], dims["g"], dims["n"])
            state = lambda s: ssd_state(p, s, *args, dims["kernel"])  # noqa: E731
            heads = ssd_heads(local, p, *args, 2)
        for kind_name, found in slots.items():
            per_layer = state(max(found))
            print(f"| {name} | {layers} | state, {kind_name} | {sum(found) / len(found):.1f} / {max(found)} | "
                  f"{per_layer / MIB:.1f} | {layers * per_layer / 2 ** 30:.2f} |")
        print(f"| {name} | {layers} | heads (any placement) | - | {heads / MIB:.1f} | {layers * heads / 2 ** 30:.2f} |")


def _shapes():
    from hf_blockdiag_cp.planning.recurrent_cost import RecurrentShape, _gdn_width, _ssd_width

    gdn = REAL[0][3]
    ssd = REAL[1][3]

    class _Gdn:  # the fields _gdn_width reads
        linear_num_key_heads, linear_num_value_heads = gdn["hk"], gdn["hv"]
        linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim = gdn["dk"], gdn["dv"], gdn["kernel"]

    # Qwen3-Next-80B-A3B: 12 full-attention layers (16 query heads of 256); Nemotron-H-8B: 4 (32 heads of 128).
    return (("Qwen3-Next-80B-A3B", RecurrentShape("gdn", 36, _gdn_width(_Gdn), 12, 16, 256, 256)),
            ("Nemotron-H-8B", RecurrentShape("ssd", 24, _ssd_width(ssd["h"], ssd["hd"], ssd["g"], ssd["n"],
                                                                    ssd["kernel"]), 4, 32, 128, 128)))


def placements(seeds: int, plot: str | None) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_balance import make_row

    from hf_blockdiag_cp.planning.hybrid_placement import choose_placement
    from hf_blockdiag_cp.planning.mirror_placement import mirror_placement

    print("\n## Attention imbalance vs recurrent state bytes per placement (per recurrent layer per rank, forward; "
          f"bytes = (P - 1) * slots * W * 4; mean / max over {seeds} seeds)\n")
    print("| model | S / P | rows | placement | imbalance mean / max | slots mean / max | MiB per layer (max) | "
          "modelled ms (mean) | chosen |")
    print("|---|---|---|---|---|---|---|---|---|")
    points = []
    host: dict[tuple[int, int], list[tuple[float, float]]] = {}  # (S, P): (choice, mirror alone) seconds
    for name, shape in _shapes():
        for full_len, p in ((128 * 1024, 8), (1024 * 1024, 64)):
            for rows in ("lognormal_8", "lognormal_32", "heavy_tail"):
                found: dict[str, list] = {}
                chosen: dict[str, int] = {}
                for seed in range(seeds):
                    row = make_row(rows, full_len, seed)
                    start = time.perf_counter()
                    choice = choose_placement(row, p, shape)
                    middle = time.perf_counter()
                    mirror_placement(row, p)
                    host.setdefault((full_len, p), []).append((middle - start, time.perf_counter() - middle))
                    chosen[choice.cost.name] = chosen.get(choice.cost.name, 0) + 1
                    for c in choice.table:
                        found.setdefault(c.name, []).append(c)
                for kind, costs in found.items():
                    imb = [c.imbalance for c in costs]
                    slots = [c.slots for c in costs]
                    mib = max(c.recurrent_bytes for c in costs) / MIB
                    ms = sum(c.cost_s for c in costs) / len(costs) * 1e3
                    points.append((name, full_len, p, kind, sum(imb) / len(imb), mib))
                    print(f"| {name} | {full_len // 1024}K / {p} | {rows} | {kind} | {sum(imb) / len(imb):.3f} / "
                          f"{max(imb):.3f} | {sum(slots) / len(slots):.1f} / {max(slots)} | {mib:.1f} | {ms:.0f} | "
                          f"{chosen.get(kind, 0)}/{seeds} |")
    print("\nHost time per step (this machine, numpy on one core; median / max over every row above): the choice, "
          "every candidate included, and the mirror placement alone\n")
    print("| S / P | choice (ms) | mirror (ms) |")
    print("|---|---|---|")
    for (full_len, p), times in host.items():
        choice_ms, mirror_ms = ([t[i] * 1e3 for t in times] for i in (0, 1))
        print(f"| {full_len // 1024}K / {p} | {statistics.median(choice_ms):.0f} / {max(choice_ms):.0f} | "
              f"{statistics.median(mirror_ms):.1f} / {max(mirror_ms):.1f} |")
    if plot:
        _plot(points, plot)


def _plot(points: list, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not importable: no plot)")
        return
    fig, ax = plt.subplots(figsize=(7, 5))
    for kind in sorted({pt[3] for pt in points}):
        xs = [pt[5] for pt in points if pt[3] == kind]
        ys = [pt[4] for pt in points if pt[3] == kind]
        ax.scatter(xs, ys, label=kind, s=18)
    ax.set_xscale("log")
    ax.set_xlabel("recurrent state MiB per layer per rank (forward)")
    ax.set_ylabel("attention imbalance (max / mean)")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-measure", action="store_true", help="arithmetic only (no processes)")
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4], help="CP sizes of the measured part")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024],
                        help="row lengths S of the measured part (divisible by 2P)")
    parser.add_argument("--seeds", type=int, default=5, help="lognormal rows whose fragment plans give the slots of "
                        "the real-model arithmetic")
    parser.add_argument("--placements", action="store_true", help="also the placement table: attention imbalance vs "
                        "recurrent bytes per placement at 128K / 8 and 1M / 64 ranks")
    parser.add_argument("--plot", default=None, help="with --placements: save the scatter to this path "
                        "(if matplotlib is importable)")
    args = parser.parse_args()
    if not args.no_measure:
        measure(args.cp, args.lengths)
    arithmetic(128 * 1024, 8, args.seeds)
    if args.placements:
        placements(args.seeds, args.plot)


if __name__ == "__main__":
    main()
