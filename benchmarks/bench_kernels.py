"""Block-diagonal attention kernels vs a per-document SDPA loop and a dense-mask SDPA call.

One packed row of ``S`` tokens (``B = 1``), ``Hq = 8`` query heads, ``Hkv = 2`` K/V heads, ``D = 64``.
Document lengths are lognormal with mean ``S / 8`` (``sigma = 1.0`` by default, so
``mu = ln(S / 8) - sigma^2 / 2``), seeded, rounded, clipped to >= 1 and packed in order until the
row holds exactly ``S`` tokens (the last document is cut).

Rows:

- every backend of :mod:`hf_blockdiag_cp.kernels` that can run the call (the others are listed
  with their reason), timed through :func:`hf_blockdiag_cp.attention.core.attend_flat` with the
  plan built once outside the timed region: exactly what one attention layer of a training step
  pays (pack, kernel, unpack; the per-step plan and schedules are shared by every layer);
- ``naive per-doc loop``: slice each document, ``F.scaled_dot_product_attention(is_causal=True,
  enable_gqa=True)``, ``torch.cat``;
- ``dense-mask sdpa``: one SDPA call with a ``[S, S]`` block-diagonal causal bool mask (built
  outside the timed region).

All rows get the same inputs: ``[1, H, S, D]`` transposed views of ``[1, S, H, D]`` tensors, the
layout transformers hands to an attention function. ``fwd`` runs under ``torch.no_grad()``;
``fwd+bwd`` runs the forward and ``torch.autograd.grad`` for q, k and v.

Time: median and minimum of ``--repeats`` runs after one warm-up (fewer when a run is slower than
``--budget-s / repeats``); the first timed run is also the one whose peak memory is measured, the
others go round-robin over the methods so that load from other processes hits every row alike.
The ratios use the minimum, the estimate least inflated by other processes on a shared machine. Peak memory: on
CUDA ``torch.cuda.max_memory_allocated()`` above what was
allocated before the run; on CPU the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` after ``malloc_trim``) above its resident set before the run. Both include
the output (and gradients), ``O(S * H * D)``; a ``[S, S]`` float32 tensor would add ``4 S^2`` bytes
(1 GiB at S = 16384). Each ``(S, dtype, mode)`` runs in a fresh subprocess so that one
configuration's allocator state cannot hide another's peak.

    python benchmarks/bench_kernels.py --threads 1          # plot: bench_kernels.png, rows: bench_kernels.json
    python benchmarks/bench_kernels.py --device cuda --quick --out /tmp/bench.png
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

NAIVE = "naive per-doc loop"
DENSE = "dense-mask sdpa"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Eager flex on CPU materialises the [Hq, S, S] float32 scores; skip it above this many bytes.
FLEX_CPU_SCORE_LIMIT = 2 << 30


def document_lengths(seq_len: int, seed: int, sigma: float) -> list[int]:
    """Lognormal lengths with mean ``seq_len / 8`` packed in order to exactly ``seq_len`` tokens."""
    rng = random.Random(seed)
    mu = math.log(seq_len / 8) - sigma * sigma / 2
    lengths: list[int] = []
    while sum(lengths) < seq_len:
        lengths.append(max(1, round(rng.lognormvariate(mu, sigma))))
    lengths[-1] -= sum(lengths) - seq_len
    return [n for n in lengths if n > 0]


# ---------------------------------------------------------------------------------------------
# worker: one (S, dtype, mode), every method, in its own process
# ---------------------------------------------------------------------------------------------

class _CpuMemory:
    """Peak resident memory of one run above the resident memory before it (Linux)."""

    def __init__(self) -> None:
        try:
            self._libc = ctypes.CDLL("libc.so.6")
        except OSError:
            self._libc = None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.available = True
        except OSError:
            self.available = False

    @staticmethod
    def _status_kib(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise RuntimeError(f"{field} missing from /proc/self/status")

    def start(self) -> int:
        gc.collect()
        if self._libc is not None:
            self._libc.malloc_trim(0)  # give freed heap back, so reused memory shows up as new RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        return self._status_kib("VmRSS")

    def peak_bytes(self, start: int) -> int:
        return max(0, self._status_kib("VmHWM") - start) * 1024


def _worker(cfg: dict) -> list[dict]:
    threads = cfg["threads"]
    import torch
    import torch.nn.functional as F

    from hf_blockdiag_cp.attention.core import attend_flat, flat_rows, kernel_spec
    from hf_blockdiag_cp.config import BACKENDS
    from hf_blockdiag_cp.kernels import BackendUnavailable, unavailable_reason
    from hf_blockdiag_cp.planning import build_varlen_plan

    if threads:
        torch.set_num_threads(threads)
    device = torch.device(cfg["device"])
    dtype = getattr(torch, DTYPES[cfg["dtype"]])
    seq_len, (num_q_heads, num_kv_heads, head_dim) = cfg["seq_len"], cfg["shape"]
    train = cfg["mode"] == "fwd+bwd"
    lengths = document_lengths(seq_len, cfg["seed"], cfg["sigma"])
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    spans = [(a, a + n) for a, n in zip(starts, lengths)]

    gen = torch.Generator().manual_seed(cfg["seed"])

    def make(heads: int) -> torch.Tensor:  # [1, H, S, D] transposed view of [1, S, H, D]
        return torch.randn(1, seq_len, heads, head_dim, generator=gen).to(device=device, dtype=dtype).transpose(1, 2)

    q, k, v = make(num_q_heads), make(num_kv_heads), make(num_kv_heads)
    for t in (q, k, v):
        t.requires_grad_(train)
    grad_out = torch.randn(1, num_q_heads, seq_len, head_dim, generator=gen).to(device=device, dtype=dtype)
    grad_flat = grad_out.transpose(1, 2).reshape(seq_len, num_q_heads, head_dim)  # for [S, Hq, D] outputs
    scale = head_dim ** -0.5
    doc_ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))

    methods: dict[str, Callable[[], torch.Tensor] | str] = {}
    spec = kernel_spec(q, k, v, dropout_p=0.0, window=None, softcap=None)  # requires_grad iff fwd+bwd
    plan = build_varlen_plan(doc_ids).to(device)
    for name in cfg["methods"]:
        if name not in BACKENDS or name == "auto":
            continue
        reason = unavailable_reason(name, spec)
        if reason is None and name == "flex" and device.type == "cpu":
            score_bytes = 4 * num_q_heads * seq_len * seq_len
            if score_bytes > FLEX_CPU_SCORE_LIMIT:
                reason = f"eager CPU flex materialises [Hq,S,S] fp32 scores ({score_bytes / 2**30:.0f} GiB)"
        if reason is None and name == "flex" and device.type == "cuda" and cfg["quick"]:
            reason = "--quick skips flex on CUDA (tens of seconds of torch.compile per shape)"
        if reason is not None:
            methods[name] = reason
            continue
        methods[name] = (lambda n: lambda: attend_flat(flat_rows(q), flat_rows(k), flat_rows(v), plan, n,
                                                       scale=scale))(name)
    if NAIVE in cfg["methods"]:
        methods[NAIVE] = lambda: torch.cat([
            F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True, scale=scale,
                                           enable_gqa=True) for a, b in spans], dim=2)
    if DENSE in cfg["methods"]:
        pos = torch.arange(seq_len, device=device)
        ids = doc_ids.to(device)
        mask = (ids[:, None] == ids[None, :]) & (pos[None, :] <= pos[:, None])  # [S, S] bool
        methods[DENSE] = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    cuda = device.type == "cuda"
    cpu_memory = None if cuda else _CpuMemory()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def run(fn: Callable[[], torch.Tensor]) -> None:
        if train:
            out = fn()
            torch.autograd.grad(out, (q, k, v), grad_out if out.dim() == 4 else grad_flat)
        else:
            with torch.no_grad():
                fn()
        sync()

    # Phase 1, per method: warm-up, then one timed run that also measures peak memory.
    # Phase 2: the remaining timed runs round-robin over the methods, so that load from other
    # processes drifting over minutes hits every method alike instead of one of them.
    results: dict[str, dict] = {}
    samples: dict[str, list[float]] = {}
    planned: dict[str, int] = {}
    for name, fn in methods.items():
        row = dict(cfg, method=name, docs=len(lengths))
        row.pop("methods")
        if isinstance(fn, str):
            results[name] = dict(row, skipped=fn)
            continue
        try:
            start = time.perf_counter()
            run(fn)  # warm-up: kernel selection, schedules cached on the plan, allocator
            warm_s = time.perf_counter() - start
            if cuda:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            elif cpu_memory.available:
                base = cpu_memory.start()
            start = time.perf_counter()
            run(fn)
            samples[name] = [time.perf_counter() - start]
            if cuda:
                peak = torch.cuda.max_memory_allocated() - base
            else:
                peak = cpu_memory.peak_bytes(base) if cpu_memory.available else None
            planned[name] = max(1, min(cfg["repeats"], int(cfg["budget_s"] / max(warm_s, 1e-9))))
            results[name] = dict(row, peak_bytes=peak)
        except (BackendUnavailable, RuntimeError, MemoryError) as err:
            results[name] = dict(row, skipped=f"{type(err).__name__}: {str(err).splitlines()[0][:120]}")
    for round_ in range(1, cfg["repeats"]):
        for name, count in planned.items():
            if count > round_:
                start = time.perf_counter()
                run(methods[name])
                samples[name].append(time.perf_counter() - start)
    for name, times in samples.items():
        results[name].update(time_s=statistics.median(times), min_s=min(times), repeats=len(times))
    return list(results.values())


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------

def _run_worker(cfg: dict) -> list[dict]:
    env = dict(os.environ)
    if cfg["threads"]:
        env["OMP_NUM_THREADS"] = str(cfg["threads"])  # before torch starts its pools
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)], env=env,
                          capture_output=True, text=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULTS "):
            return json.loads(line[len("RESULTS "):])
    last = ((proc.stderr or proc.stdout).strip().splitlines() or ["no output"])[-1]
    return [dict(cfg, method="(every method)", skipped=f"worker failed (rc={proc.returncode}): {last[:200]}")]


def _fmt_bytes(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f} MiB"


def print_table(rows: list[dict]) -> None:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["seq_len"], r["dtype"], r["mode"]), []).append(r)
    for (seq_len, dtype, mode), group in groups.items():
        timed = {r["method"]: r for r in group if "time_s" in r}
        naive = timed.get(NAIVE, {}).get("min_s")
        dense = timed.get(DENSE, {}).get("min_s")
        docs = group[0]["docs"] if "docs" in group[0] else "?"
        print(f"\n### S={seq_len}, {dtype}, {mode} ({docs} documents; [S,S] bool mask = "
              f"{_fmt_bytes(seq_len * seq_len)}, [S,S] fp32 = {_fmt_bytes(4 * seq_len * seq_len)})\n")
        print("| method | median (ms) | min (ms) | vs naive loop (x) | speed-up vs dense mask (x) | peak memory "
              "| runs |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in group:
            if "time_s" not in r:
                print(f"| {r['method']} | skipped: {r['skipped']} | | | | | |")
                continue
            t = r["min_s"]
            vs_naive = f"{t / naive:.2f}" if naive else "n/a"
            vs_dense = f"{dense / t:.1f}" if dense else "n/a"
            print(f"| {r['method']} | {1e3 * r['time_s']:,.1f} | {1e3 * t:,.1f} | {vs_naive} | {vs_dense} "
                  f"| {_fmt_bytes(r['peak_bytes'])} | {r['repeats']} |")


def save_plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\n(matplotlib is not installed: no plot written to {path}; pip install -e '.[bench]')")
        return
    configs = sorted({(r["seq_len"], r["dtype"], r["mode"]) for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(configs)), 4.5))
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        times = []
        for cfg in configs:
            match = [r for r in rows if (r["seq_len"], r["dtype"], r["mode"]) == cfg and r["method"] == method]
            times.append(1e3 * match[0]["time_s"] if match and "time_s" in match[0] else float("nan"))
        ax.bar([c + i * width for c in range(len(configs))], times, width, label=method)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(configs))])
    ax.set_xticklabels([f"S={s}\n{d} {m}" for s, d, m in configs], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("median time per layer call (ms, log)")
    ax.set_title(f"block-diagonal attention, {rows[0]['device']}")
    ax.legend(fontsize=7, ncol=min(len(methods), 5), loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="torch device of the inputs: cpu, cuda or cuda:N")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=None, help="default 4096 16384 (--quick: 4096)")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=None,
                        help="default fp32 bf16 (--quick on CUDA: bf16)")
    parser.add_argument("--modes", nargs="+", choices=["fwd", "fwd+bwd"], default=["fwd", "fwd+bwd"],
                        help="forward only (no_grad) and/or forward + backward for q, k, v")
    parser.add_argument("--methods", nargs="+", default=None,
                        help=f"backend names and/or '{NAIVE}', '{DENSE}' (default: all)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch default)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs after the warm-up (default 3, quick 2)")
    parser.add_argument("--budget-s", type=float, default=30.0, help="rough cap on timed seconds per row")
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of document lengths")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document lengths and the inputs")
    parser.add_argument("--quick", action="store_true", help="one short sequence length, fewer repeats")
    parser.add_argument("--out", default="bench_kernels.png",
                        help="PNG path of the plot (needs matplotlib: pip install -e '.[bench]'); the rows go to a "
                             "JSON file next to it; '' writes neither")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker is not None:
        print("RESULTS " + json.dumps(_worker(json.loads(args.worker))))
        return

    from hf_blockdiag_cp.config import BACKENDS

    seq_lens = args.seq_lens or ([4096] if args.quick else [4096, 16384])
    dtypes = args.dtypes or (["bf16"] if args.quick and args.device.startswith("cuda") else ["fp32", "bf16"])
    methods = args.methods or [b for b in BACKENDS if b != "auto"] + [NAIVE, DENSE]
    repeats = args.repeats or (2 if args.quick else 3)
    print(f"device={args.device} threads={args.threads or 'default'} B=1 Hq=8 Hkv=2 D=64, lognormal document "
          f"lengths (mean S/8, sigma={args.sigma}, seed={args.seed}); median of up to {repeats} runs after 1 warm-up")
    rows: list[dict] = []
    for seq_len in seq_lens:
        for dtype in dtypes:
            for mode in args.modes:
                cfg = dict(device=args.device, seq_len=seq_len, dtype=dtype, mode=mode, methods=methods,
                           shape=(8, 2, 64), threads=args.threads, repeats=repeats, budget_s=args.budget_s,
                           sigma=args.sigma, seed=args.seed, quick=args.quick)
                start = time.perf_counter()
                got = _run_worker(cfg)
                print(f"  S={seq_len} {dtype} {mode}: {time.perf_counter() - start:.0f}s", file=sys.stderr, flush=True)
                rows += got
    print_table(rows)
    if args.out:
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(rows, f, indent=1)
        save_plot([r for r in rows if "time_s" in r] or rows, args.out)


if __name__ == "__main__":
    main()
