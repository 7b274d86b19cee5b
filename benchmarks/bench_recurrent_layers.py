"""Speed of the package's recurrent path on CPU (issue 24): packed rows vs transformers' own fallback, CP = 2 vs 1.

``--part layers``: per mixer type, a model of ONE decoder layer of that type (tiny sizes, like the test configs)
runs forward + backward on a packed row of ``--tokens`` tokens in ``--docs`` lognormal documents through
``attn_implementation="blockdiag_cp"`` (every document restarts its state), once per ``recurrent_backend``
(``model``: transformers' function once per document; ``torch``: the package's chunked ops, one varlen call;
``auto``: the default, per kind), and
the stock model (sdpa, transformers' torch fallbacks) runs the same tokens as ONE unpacked sequence (no resets:
the cost floor; the acceptance bound is ratio <= 1.5). ``tiny-qwen3-next`` is the whole 4-layer model of
``configs/model/tiny-qwen3-next.json``. One thread, median of ``--repeats`` after one warm-up.

``--part cp``: one training step (forward + backward) of ``configs/model/tiny-qwen3-next.json`` (``--models``: also
``tiny-nemotron-h.json``, Mamba2 / SSD) on one packed row of ``--tokens`` tokens: CP = 1 (one process, one thread)
vs CP = P for each of ``--worlds`` (P gloo processes, one thread each, the placement the collator chooses for the
model), per recurrent backend; the bounds (issue 36) are CP = 2 / CP = 1 <= 0.52 and CP = 4 / CP = 1 <= 0.28. Wall
time per step (the slowest rank) and the CPU time the busiest rank spent in the step (``getrusage``, user plus
system: on a shared, loaded machine the processes compete for cores with other work, which inflates wall time but
not CPU time; gloo waits block), its user and system parts also apart (system time is page faults and gloo's socket
calls, not the package's compute), after ``--warmup`` untimed steps (a process's allocator settles in ~3), and the
most any rank waited per step for its recurrent summary gathers (``comm_stats``'s
``waited_s``; ``--no-overlap`` waits for each gather as soon as it started, the comparison for the overlap of the
gather with the fragments that need no incoming state). Processes meet through a file store in a temporary
directory (no port). Every run is a spawn (CP = 1 too); ``--rounds`` rounds run CP = 1 and each CP = P in turn and the
ratio is taken per round (median and range printed): this VM's speed drifts by up to 20 % over minutes, more than
the differences the bounds ask about. ``--floor`` adds, per CP size, the same P processes without CP (each rank's
shard as a one-process packed row, its attention time swapped for CP = 1's share: :mod:`cp_floor`), what P processes
cost on this machine before any CP code runs; ``--keep-heap`` fixes glibc's heap trim threshold in every process (a CP
rank otherwise gives its heap back at the end of a step and page-faults it in again in the next).

transformers' Mamba1 fallback backward is quadratic in the length (hours at 16K), so ``mamba`` is timed forward
only (marked ``fwd``) unless ``--mamba-backward``.

    python benchmarks/bench_recurrent_layers.py --part layers            # 16K tokens, 8 docs
    python benchmarks/bench_recurrent_layers.py --part cp --steps 3
    python benchmarks/bench_recurrent_layers.py --part cp --backends auto --worlds 2 4 \
        --models tiny-qwen3-next tiny-nemotron-h [--floor --keep-heap]
    python benchmarks/bench_recurrent_layers.py --part layers --types gdn ssd --tokens 4096
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_recurrent_ops import lognormal_lengths  # noqa: E402
from cp_floor import AttentionClock, floor_cpu, keep_heap, shard_documents  # noqa: E402

from hf_blockdiag_cp.recurrent.runs import GATHER  # noqa: E402
from hf_blockdiag_cp.training import close_process_groups  # noqa: E402

#: Per mixer type: (model type, config overrides making its one decoder layer that mixer).
LAYERS: dict[str, tuple[str, dict]] = {
    "gdn": ("qwen3_next", {"num_hidden_layers": 1, "layer_types": ["linear_attention"]}),
    "kda": ("kimi_linear", {"num_hidden_layers": 1, "layer_types": ["linear_attention"], "mlp_layer_types": ["dense"]}),
    "ssd": ("bamba", {"num_hidden_layers": 1, "attn_layer_indices": []}),
    "mamba": ("mamba", {"num_hidden_layers": 1}),
    "conv": ("lfm2", {"num_hidden_layers": 1, "layer_types": ["conv"], "full_attn_idxs": []}),
}
BACKENDS = ("model", "torch", "auto")
#: ``--part cp`` models: whole tiny hybrids under ``configs/model/`` (3 recurrent layers + 1 attention layer each).
CP_MODELS = ("tiny-qwen3-next", "tiny-nemotron-h")
ENV = "HF_BLOCKDIAG_CP_RECURRENT_BACKEND"


def _config(kind: str):
    from transformers import AutoConfig

    from hf_blockdiag_cp.conformance.configs import tiny_config
    if kind in CP_MODELS:
        return AutoConfig.from_pretrained(ROOT / "configs" / "model" / f"{kind}.json")
    model_type, overrides = LAYERS[kind]
    config = copy.deepcopy(tiny_config(model_type))
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _step(model, inputs: dict, backward: bool) -> None:
    model.zero_grad(set_to_none=True)
    logits = model(**inputs, use_cache=False).logits
    if backward:
        logits.float().square().mean().backward()


def _median(fn, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def layers(args) -> None:
    from hf_blockdiag_cp.conformance.runs import build_model
    lens = lognormal_lengths(args.tokens, args.docs, args.seed)
    print(f"# {args.tokens} tokens, docs {lens}, 1 thread, torch {torch.__version__}")
    print("| mixer (model) | pass | stock, 1 sequence | ours `model` | ours `torch` | ours `auto` | ratio `model` | "
          "ratio `torch` | ratio `auto` |")
    print("|---|---|---|---|---|---|---|---|---|")
    for kind in args.types:
        config = _config(kind)
        backward = kind != "mamba" or args.mamba_backward
        gen = torch.Generator().manual_seed(args.seed)
        ids = torch.randint(3, config.vocab_size - 2, (1, args.tokens), generator=gen)
        packed_pos = torch.cat([torch.arange(n) for n in lens])[None]
        stock = build_model(config, None).train()
        stock_t = _median(lambda: _step(stock, {"input_ids": ids}, backward), args.repeats)
        ours = build_model(config, "blockdiag_cp").train()
        row = []
        for backend in BACKENDS:
            os.environ[ENV] = backend
            row.append(_median(lambda: _step(ours, {"input_ids": ids, "position_ids": packed_pos}, backward),
                               args.repeats))
        os.environ.pop(ENV, None)
        name = kind if kind == "tiny-qwen3-next" else f"{kind} ({LAYERS[kind][0]})"
        cells = " | ".join(f"{t * 1e3:.0f} ms" for t in row)
        ratios = " | ".join(f"{t / stock_t:.2f}" for t in row)
        kind_pass = "fwd+bwd" if backward else "fwd"
        print(f"| {name} | {kind_pass} | {stock_t * 1e3:.0f} ms | {cells} | {ratios} |", flush=True)


def _cp_worker(rank: int, world: int, store_path: str, spec: dict, out_path: str) -> None:
    import torch.distributed as dist
    import transformers

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.conformance.runs import build_model
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()  # the kernels' "falling back to PyTorch" notes, once per process
    if spec["keep_heap"] and not keep_heap():
        raise RuntimeError("--keep-heap needs glibc's mallopt")
    os.environ[ENV] = spec["backend"]
    group = None
    alone = spec.get("alone", 0)  # the floor: this rank's shard of CP = alone, in one process
    if world > 1 and not alone:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
        group = dist.group.WORLD
    config = _config(spec["model"])
    model = build_model(config, "blockdiag_cp").train()
    gen = torch.Generator().manual_seed(spec["seed"])
    docs = [torch.randint(3, config.vocab_size - 2, (n,), generator=gen).tolist() for n in spec["lens"]]
    make = functools.partial(bd.PackingCollator, pad_token_id=config.pad_token_id, model_config=config,
                             config=bd.BlockDiagCPConfig(recurrent_backend=spec["backend"]))
    if alone:
        shard = make(spec["tokens"], cp_size=alone, cp_rank=rank)([{"input_ids": d} for d in docs])
        batch = make(spec["tokens"] // alone)([{"input_ids": d} for d in shard_documents(shard)])
    else:
        batch = make(spec["tokens"], group=group)([{"input_ids": d} for d in docs])
    clock = AttentionClock(model) if spec["floor"] else None
    if spec.get("no_overlap"):  # the comparison: wait for each summary gather as soon as it started
        from hf_blockdiag_cp.recurrent import driver
        started = driver.gather

        def eager(runs, sent, width, device, deferred=None):
            out = started(runs, sent, width, device, deferred)
            if deferred is not None:
                deferred.wait()
            return out
        driver.gather = eager
    times = []
    waited = bd.comm_stats(batch["cp_context"]).waited_s if group is not None else {}
    for i in range(spec["warmup"] + spec["steps"]):
        if group is not None:
            dist.barrier()
        if clock is not None:
            clock.reset()
        before = waited.get(GATHER, 0.0)
        start, usage = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        model.zero_grad(set_to_none=True)
        out = model(**batch)
        out.loss.backward()
        after = resource.getrusage(resource.RUSAGE_SELF)
        if group is not None:  # the gradient all-reduce of data parallelism is not part of the CP cost
            dist.barrier()
        if i >= spec["warmup"]:
            # the kernel's share (page faults, gloo's socket calls) apart: the user time is the package's compute
            user, system = after.ru_utime - usage.ru_utime, after.ru_stime - usage.ru_stime
            times.append((time.perf_counter() - start, user + system, waited.get(GATHER, 0.0) - before, user, system,
                          clock.seconds if clock is not None else 0.0))
    Path(f"{out_path}.{rank}").write_text(json.dumps(times))
    if group is not None:
        close_process_groups()


def _cp_time(world: int, spec: dict) -> tuple[tuple[float, ...], list[tuple[float, float]]]:
    """(wall, CPU, recurrent gather wait, user CPU, system CPU) seconds of one step: per step the slowest rank (its
    wall, CPU and wait) and the busiest rank's user and system parts of its CPU time, median over steps; and each
    rank's median (CPU, attention CPU). CP = 1 runs in a spawned process too, like every CP size (the same start,
    imports and allocator history); with ``spec["alone"]`` the ``world`` processes share no group (the floor)."""
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "times")
        mp.start_processes(_cp_worker, args=(world, store, spec, out), nprocs=world, start_method="spawn")
        per_rank = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    steps = list(zip(*per_rank))  # per step, each rank's (wall, cpu, wait, user, sys, attention)
    slowest = tuple(statistics.median(max(r[k] for r in step) for step in steps) for k in range(3))
    busiest = [max(step, key=lambda r: r[1]) for step in steps]
    ranks = [(statistics.median(s[1] for s in rank), statistics.median(s[5] for s in rank)) for rank in per_rank]
    return slowest + tuple(statistics.median(r[k] for r in busiest) for k in (3, 4)), ranks


def _spread(values: list[float]) -> str:
    """``median [min-max]`` of per-round ratios."""
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def cp(args) -> None:
    lens = lognormal_lengths(args.tokens, args.docs, args.seed)
    worlds = [w for w in args.worlds if w > 1]
    for model in args.models:
        print(f"# {model}, one training step (fwd+bwd) on a {args.tokens}-token row, docs {lens}, one thread per "
              f"rank, median of {args.steps} steps per run after {args.warmup} untimed, {args.rounds} rounds (CP = 1 "
              f"and each CP = P in turn); "
              f"CP = P / CP = 1: per round the busiest rank's CPU time over CP = 1's (wall in brackets), median "
              f"[min-max] over the rounds; user: the same ratio of user CPU time alone (the busiest rank's; the "
              f"system time, sys, is the kernel's: page faults, gloo's socket calls); wait: the most any rank "
              f"waited per step for its recurrent summary gathers{' (no overlap)' if args.no_overlap else ''}")
        if args.floor:
            print("floor columns: alone / CP = 1: the busiest of P processes at once that each run one rank's shard "
                  "as a one-process packed row (its fragments as documents, no CP) over CP = 1's CPU time; floor: "
                  "the same with each shard's own attention time swapped for CP = 1's / P (benchmarks/cp_floor.py)")
        floor_head = lambda w: f" | CP = {w} alone / CP = 1 | CP = {w} floor" if args.floor else ""  # noqa: E731
        print("| recurrent_backend | CP = 1 CPU (wall) | CP = 1 sys | " + " | ".join(
            f"CP = {w} CPU (wall) | CP = {w} / CP = 1 CPU | (wall) | (user) | CP = {w} sys | CP = {w} wait"
            + floor_head(w) for w in worlds) + " |")
        print("|---|---|---|" + ("---|---|---|---|---|---|" + "---|---|" * args.floor) * len(worlds))
        for backend in args.backends:
            spec = {"backend": backend, "seed": args.seed, "lens": lens, "tokens": args.tokens, "steps": args.steps,
                    "warmup": args.warmup, "model": model, "no_overlap": args.no_overlap, "floor": args.floor,
                    "keep_heap": args.keep_heap}
            # The machine's speed drifts (a shared VM: CP = 1 alone measured 1.65-2.04 s within ten minutes), so
            # CP = 1 and CP = P (and its floor) alternate and each round's ratio compares neighbouring runs.
            rounds, alone = [], []
            for _ in range(args.rounds):
                rounds.append([_cp_time(w, spec) for w in (1, *worlds)])
                if args.floor:
                    alone.append([_cp_time(w, {**spec, "alone": w})[1] for w in worlds])
            med = lambda i, k: statistics.median(r[i][0][k] for r in rounds)  # noqa: E731
            cells = [f"{med(0, 1) * 1e3:.0f} ms ({med(0, 0) * 1e3:.0f})", f"{med(0, 4) * 1e3:.0f} ms"]
            for j, world in enumerate(worlds, start=1):
                ratio = lambda k: _spread([r[j][0][k] / r[0][0][k] for r in rounds])  # noqa: E731
                cells += [f"{med(j, 1) * 1e3:.0f} ms ({med(j, 0) * 1e3:.0f})", ratio(1), ratio(0), ratio(3),
                          f"{med(j, 4) * 1e3:.0f} ms", f"{med(j, 2) * 1e3:.1f} ms"]
                if args.floor:
                    one = [(r[0][0][1], r[0][1][0][1]) for r in rounds]  # CP = 1's (CPU, attention CPU) per round
                    cells += [_spread([max(c for c, _ in a[j - 1]) / cpu for a, (cpu, _) in zip(alone, one)]),
                              _spread([floor_cpu(a[j - 1], att, world) / cpu for a, (cpu, att) in zip(alone, one)])]
            print(f"| {backend} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["layers", "cp"], default="layers",
                        help="layers: one layer per mixer type vs the stock layer; cp: a CP = 2 vs CP = 1 step")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens in the packed row (default 16384)")
    parser.add_argument("--docs", type=int, default=8, help="lognormal documents in the row (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="--part layers: timed runs, median (default 3)")
    parser.add_argument("--steps", type=int, default=3, help="--part cp: timed steps per run, median (default 3)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="--part cp: untimed steps first (default 3: the allocator settles; one process still "
                             "page-faults ~50-450 ms of system time per step in its first three steps)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="--part cp: rounds of CP = 1 and each CP = P in turn; ratios per round (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the document lengths, tokens and weights")
    parser.add_argument("--types", nargs="+", default=[*LAYERS, "tiny-qwen3-next"],
                        choices=[*LAYERS, "tiny-qwen3-next"], help="--part layers: mixers to time")
    parser.add_argument("--backends", nargs="+", default=["model", "torch", "auto"],
                        choices=["model", "torch", "auto"], help="--part cp: recurrent backends to time")
    parser.add_argument("--models", nargs="+", default=["tiny-qwen3-next"], choices=CP_MODELS,
                        help="--part cp: the tiny hybrids to step (default tiny-qwen3-next)")
    parser.add_argument("--worlds", nargs="+", type=int, default=[2],
                        help="--part cp: CP sizes to compare with CP = 1 (default 2)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="--part cp: wait for each recurrent summary gather at once (the comparison)")
    parser.add_argument("--floor", action="store_true",
                        help="--part cp: also run each CP size's shards without CP, the no-CP floor (cp_floor.py)")
    parser.add_argument("--keep-heap", action="store_true",
                        help="--part cp: fix glibc's heap trim threshold in every process (no per-step page faults)")
    parser.add_argument("--mamba-backward", action="store_true", help="also time the stock Mamba1 backward")
    args = parser.parse_args()
    for flag, value, least in (("--steps", args.steps, 1), ("--rounds", args.rounds, 1), ("--warmup", args.warmup, 0)):
        if value < least:
            parser.error(f"{flag} {value}: must be >= {least}")
    bad = [w for w in args.worlds if w < 1 or args.tokens % w]
    if args.part == "cp" and bad:
        parser.error(f"--worlds {bad[0]}: must be >= 1 and divide --tokens {args.tokens}")
    if args.keep_heap and not keep_heap():  # checked before any spawn: a usage error, not a traceback from a rank
        parser.error("--keep-heap: this libc has no glibc mallopt")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import transformers
    transformers.logging.set_verbosity_error()
    layers(args) if args.part == "layers" else cp(args)


if __name__ == "__main__":
    main()
