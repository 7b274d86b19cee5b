"""Throughput and peak memory of the training example at CP = 1 vs CP = 2, and the longest row that
fits a memory budget.

Runs examples/train_packed_cp.py as real processes: CP = 1 as one process (all cores), CP = 2 with
`accelerate launch --config_file configs/accelerate/cpu_cp2.yaml` (one core each on a 2-core box), on
the same total sequence length, and reads each run's --summary-json.

    python benchmarks/bench_train_scaling.py --seq-lens 8192 32768 --steps 4
    python benchmarks/bench_train_scaling.py --max-memory-gib 20 --steps 1 -- --max-chars 4096  # longest seq_len
    python benchmarks/bench_train_scaling.py --real-vocab --own-seq-lens 1024 2048 --seq-lens 2048 4096 --steps 1 \\
        --cp-sizes 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(cp_size: int, seq_len: int, steps: int, extra: list[str]) -> dict | None:
    """One training run; ``None`` if it failed (e.g. killed for memory)."""
    with tempfile.TemporaryDirectory() as tmp:
        summary = Path(tmp) / "summary.json"
        script = [str(ROOT / "examples" / "train_packed_cp.py"), "--cp-size", str(cp_size), "--seq-len", str(seq_len),
                  "--steps", str(steps), "--no-progress", "--summary-json", str(summary), *extra]
        if cp_size == 1:
            cmd = [sys.executable, *script]
        else:
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "configs" / "accelerate" / "cpu_cp2.yaml"), *script]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ})
        if proc.returncode != 0 or not summary.exists():
            sys.stderr.write(f"cp={cp_size} seq_len={seq_len} failed (exit "
                             f"{proc.returncode}):\n{proc.stderr[-2000:]}\n")
            return None
        return json.loads(summary.read_text())


def table(seq_lens: list[int], cp_sizes: list[int], steps: int, extra: list[str]) -> None:
    print("| seq_len | CP | processes | tokens/s | peak RSS per rank (GiB) | K/V exchanged per step per rank (MiB) |")
    print("|---:|---:|---:|---:|---|---|")
    for seq_len in seq_lens:
        for cp in cp_sizes:
            r = run(cp, seq_len, steps, extra)
            if r is None:
                print(f"| {seq_len} | {cp} | {cp} | failed | | |")
                continue
            peaks = ", ".join(f"{g:.2f}" for g in r["peak_memory_gib_per_rank"])
            kv = ", ".join(f"{b / 2**20:.1f}" for b in r["kv_exchange_bytes_per_step_per_rank"])
            print(f"| {seq_len} | {cp} | {r['world']} | {r['tokens_per_s']:,.0f} | {peaks} | {kv} |", flush=True)


def machine_memory_gib() -> float:
    """Physical memory of this machine (Linux), to never launch a run that would need more."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    return float("inf")


def longest(cp: int, budget_gib: float, steps: int, start: int, extra: list[str], scope: str) -> None:
    """Largest seq_len (a multiple of 4096 * cp) whose peak RSS stays within the budget, per rank
    (``scope="rank"``) or summed over the CP ranks (``"total"``).

    Peak RSS grows linearly in seq_len here (no O(S^2) tensor anywhere), so two probes at ``start`` and
    ``2 * start`` give the line; the predicted maximum is then run to confirm it, stepping down 4 % at a
    time if it does not fit. A prediction whose processes would need more than this machine's memory
    is reported as extrapolated, never launched (an OOM kill could take the machine's other work with it).
    """
    unit = 4096 * cp

    def peak_of(seq_len: int) -> float | None:
        r = run(cp, seq_len, steps, extra)
        if r is None:
            return None
        peaks = r["peak_memory_gib_per_rank"]
        peak = max(peaks) if scope == "rank" else sum(peaks)
        print(f"  cp={cp} seq_len={seq_len}: peak RSS {', '.join(f'{g:.2f}' for g in peaks)} GiB", flush=True)
        return peak

    x0, x1 = start, 2 * start
    y0, y1 = peak_of(x0), peak_of(x1)
    if y0 is None or y1 is None:
        print(f"| {cp} | probe failed | {budget_gib} GiB |", flush=True)
        return
    slope = (y1 - y0) / (x1 - x0)
    guess = int(x1 + (budget_gib - y1) / slope) // unit * unit
    scope_text = "per rank" if scope == "rank" else "for all CP ranks together"
    need = budget_gib * (cp if scope == "rank" else 1)
    if need > 0.9 * machine_memory_gib():
        # Cannot run it here: extrapolate from the longest row this machine can hold (80 % of it over
        # all ranks), which sits far closer to the budget than the small probes.
        per_rank = 0.8 * machine_memory_gib() / (cp if scope == "rank" else 1)
        far = int(x1 + (per_rank - y1) / slope) // unit * unit
        y_far = peak_of(far) if far > x1 else None
        if y_far is not None:
            x1, y1, slope = far, y_far, (y_far - y1) / (far - x1)
        guess = int(x1 + (budget_gib - y1) / slope) // unit * unit
        print(f"| {cp} | ~{guess} (extrapolated from {x1} tokens at {y1:.2f} GiB, {slope * 2**30 / 1024:.1f} KiB "
              f"per token; {cp} x {budget_gib} GiB exceeds this machine) | {budget_gib} GiB {scope_text} |", flush=True)
        return
    while guess > x1:
        y = peak_of(guess)
        if y is not None and y <= budget_gib:
            print(f"| {cp} | {guess} (measured) | {budget_gib} GiB {scope_text} |", flush=True)
            return
        guess = int(guess * 0.96) // unit * unit
    print(f"| {cp} | no length above {x1} fits | {budget_gib} GiB {scope_text} |", flush=True)


# ---- real vocabulary: the model's own loss vs bd.chunked_causal_lm_loss (a child process, or torchrun, per run) ----

#: --real-vocab rows are packed from documents of this many tokens (a row length is a multiple of it).
REAL_VOCAB_DOC = 512
#: Llama-3's vocabulary on a small body: the head dominates memory, as in the issue's shape.
REAL_VOCAB = dict(vocab_size=128256, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5)


def real_vocab_child(spec: dict) -> dict | None:
    """One run on this process (one CP rank under torchrun): build the model, measure a step's fwd+bwd (tensor peak
    op by op, then process peak RSS), time steps. Under torchrun the row is sharded over the ranks; the largest
    per-rank numbers are returned by rank 0 (``None`` on the others).

    ``spec``: ``loss`` ("own" | "chunked"), ``seq_len`` (the whole row), ``checkpointing``, ``steps`` (timed steps
    after the measured one), ``chunk_size``.
    """
    import resource

    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    import hf_blockdiag_cp as bd
    from tests.memory import TensorMemory

    torch.set_num_threads(1)
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = bd.init_device_mesh(world) if world > 1 else None  # dp 1 x cp world
    seq_len = spec["seq_len"]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**REAL_VOCAB, max_position_embeddings=seq_len))
    model.set_attn_implementation("blockdiag_cp")
    model.train()
    if spec["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    gen = torch.Generator().manual_seed(1)
    docs = [{"input_ids": torch.randint(1, REAL_VOCAB["vocab_size"], (REAL_VOCAB_DOC,), generator=gen).tolist()}
            for _ in range(seq_len // REAL_VOCAB_DOC)]
    batch = bd.PackingCollator(seq_len, pad_token_id=0, group=mesh["cp"] if mesh is not None else None)(docs)

    def step() -> float:
        if spec["loss"] == "chunked":
            loss = bd.chunked_causal_lm_loss(model, batch, chunk_size=spec["chunk_size"])
        else:
            loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        base_rss = int(f.read().split()[1]) * page
    with TensorMemory() as mem:
        step()
    cpu = 0.0  # CPU seconds (one thread per rank): on a shared machine wall time measures the neighbours
    for _ in range(spec["steps"]):
        start = time.process_time()
        step()
        cpu += time.process_time() - start
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    mine = {"tensor_peak_gib": mem.peak_bytes / 2**30, "largest_tensor_elems": mem.largest_numel,
            "base_rss_gib": base_rss / 2**30, "peak_rss_gib": peak_rss / 2**30, "cpu_s": cpu}
    ranks = [mine]
    if mesh is not None:
        import torch.distributed as dist

        ranks, rank = [None] * world, dist.get_rank()
        dist.all_gather_object(ranks, mine)
        bd.training.close_process_groups()  # after the last collective: no gloo abort at exit
        if rank != 0:
            return None
    worst = {k: max(r[k] for r in ranks) for k in mine if k != "cpu_s"}  # per rank: the largest
    total_cpu = sum(r["cpu_s"] for r in ranks)
    return {**spec, "cp_size": world, **worst,
            "tokens_per_cpu_s": seq_len * spec["steps"] / total_cpu if spec["steps"] else None}


def real_vocab_run(spec: dict, cp_size: int = 1) -> dict | None:
    """:func:`real_vocab_child` in a fresh process (``cp_size`` 1), or on ``cp_size`` gloo ranks under torchrun
    (its standalone rendezvous: the launcher binds and serves the store)."""
    launcher = [] if cp_size == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(cp_size)]
    proc = subprocess.run([sys.executable, *launcher, __file__, "--real-vocab-child", json.dumps(spec)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        sys.stderr.write(f"{spec} at CP={cp_size} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}\n")
        return None
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def real_vocab_table(cases: list[tuple[str, bool, list[int]]], cp_sizes: list[int], steps: int, chunk_size: int,
                     budget_gib: float) -> None:
    """Per (CP size, loss, checkpointing): a row per measured length (memory per rank: the largest rank's), then
    the longest row within ``budget_gib`` per rank, extrapolated linearly from the two longest measured rows
    (peak RSS of the process, parameters included)."""
    print("| CP | loss | checkpointing | L (row) | tensor peak fwd+bwd per rank (GiB) | largest tensor (elements) | "
          "peak RSS per rank (GiB) | tokens per CPU-second (1 thread per rank) "
          "|\n|---:|---|---|---:|---:|---:|---:|---:|")
    longest = []
    for cp in cp_sizes:
        for loss, checkpointing, seq_lens in cases:
            points = []
            for seq_len in seq_lens:
                r = real_vocab_run(dict(loss=loss, seq_len=seq_len, checkpointing=checkpointing, steps=steps,
                                        chunk_size=chunk_size), cp)
                if r is None:
                    print(f"| {cp} | {loss} | {checkpointing} | {seq_len} | failed | | | |", flush=True)
                    continue
                points.append((seq_len, r["peak_rss_gib"]))
                print(f"| {cp} | {loss} | {checkpointing} | {seq_len} | {r['tensor_peak_gib']:.2f} | "
                      f"{r['largest_tensor_elems']:,} | {r['peak_rss_gib']:.2f} | "
                      f"{r['tokens_per_cpu_s'] or float('nan'):,.1f} |", flush=True)
            if len(points) >= 2:
                (x0, y0), (x1, y1) = points[-2], points[-1]
                slope = (y1 - y0) / (x1 - x0)
                longest.append((cp, loss, checkpointing, int(x1 + (budget_gib - y1) / slope), slope * 2**30 / 1024))
    print(f"\n| CP | loss | checkpointing | longest row within {budget_gib} GiB per rank (extrapolated) | peak RSS per "
          "rank per row token |\n|---:|---|---|---:|---:|")
    for cp, loss, checkpointing, tokens, per_token in longest:
        print(f"| {cp} | {loss} | {checkpointing} | ~{tokens:,} | {per_token:.0f} KiB |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768],
                   help="total row lengths (all CP ranks together) of the throughput table")
    p.add_argument("--steps", type=int, default=4, help="training steps per run (the first is not timed)")
    p.add_argument("--max-memory-gib", type=float, default=None, help="find the longest seq_len within this budget")
    p.add_argument("--start", type=int, default=65536, help="first of the two probes of the search")
    p.add_argument("--scope", choices=["rank", "total"], default="rank",
                   help="budget per rank, or for the CP ranks together (when they share one machine's memory)")
    p.add_argument("--cp-sizes", type=int, nargs="+", default=[1, 2], choices=[1, 2], help="CP sizes to run")
    p.add_argument("--real-vocab", action="store_true",
                   help="Llama-3 vocabulary (128,256), hidden 512, 2 layers, at each of --cp-sizes: the model's own "
                        "loss at --own-seq-lens vs the chunked loss at --seq-lens (with and without checkpointing)")
    p.add_argument("--own-seq-lens", type=int, nargs="+", default=[1024, 2048],
                   help="--real-vocab: row lengths measured with the model's own loss (keep small: ~1.5 MiB per token)")
    p.add_argument("--chunk-size", type=int, default=256, help="--real-vocab: tokens per chunk of the chunked loss")
    p.add_argument("--budget-gib", type=float, default=20.0,
                   help="--real-vocab: memory budget per rank for the extrapolated longest row")
    p.add_argument("--real-vocab-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("extra", nargs="*", help="more options for the example (after --)")
    args = p.parse_args()
    if args.real_vocab_child is not None:
        result = real_vocab_child(json.loads(args.real_vocab_child))
        if result is not None:  # rank 0 (or the one process)
            print(json.dumps(result))
        return
    if args.real_vocab:
        odd = [n for n in (*args.own_seq_lens, *args.seq_lens) if n <= 0 or n % REAL_VOCAB_DOC]
        if odd:  # the rows are whole documents of REAL_VOCAB_DOC tokens: another length packs nothing or cuts one
            p.error(f"--real-vocab: --own-seq-lens and --seq-lens must be multiples of {REAL_VOCAB_DOC} (got {odd})")
        real_vocab_table([("own", False, args.own_seq_lens), ("chunked", False, args.seq_lens),
                          ("chunked", True, args.seq_lens)], args.cp_sizes, args.steps, args.chunk_size,
                         args.budget_gib)
        return
    if args.max_memory_gib is None:
        table(args.seq_lens, args.cp_sizes, args.steps, args.extra)
        return
    print("| CP | longest seq_len that trained | budget |")
    print("|---:|---:|---|")
    for cp in args.cp_sizes:
        longest(cp, args.max_memory_gib, args.steps, args.start, args.extra, args.scope)


if __name__ == "__main__":
    main()
