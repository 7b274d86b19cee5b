"""Vision-language models on packed rows under CP: the image feature all-to-all's bytes, and a CP = 2 training step.

Part ``bytes`` (real gloo processes, P = 2 and 4): one training step (forward + backward) of a tiny Qwen2.5-VL
(``configs/model/tiny-qwen2_5-vl.json``) and a tiny Qwen3-VL (the same text model; two deepstack levels) on one packed
row of image-text documents (about 30 % image placeholder tokens, the generator of
``examples/train_vlm_packed_cp.py``, text of random letters). Measured: the bytes each rank sent and received through
the feature all-to-all, forward and backward (``media_stats``). Formula, from the context's placement and the plan's
encoder of each image only:

    received (forward) = rows of images encoded on another rank whose placeholder tokens this rank holds
                         x text hidden x (1 + deepstack levels) x element size
    sent (forward)     = rows of images this rank encodes whose placeholder tokens another rank holds  x (same)

and the backward moves the same amounts the other way (the gradients of the feature rows).

Part ``time``: one training step (forward + backward, the model's own loss; no optimizer) of the tiny Qwen2.5-VL on
one packed row of ``--seq-lens`` tokens: CP = 1 (one process, one thread) vs CP = 2 (two gloo processes, one thread
each, balanced placement) on the same row. Per step: wall time of the slowest rank and the CPU time of the busiest
rank (``time.process_time``: other work on a shared machine inflates wall time, not CPU time); median of
``--repeats`` steps after one warm-up. The collator (host planning) is not timed. Processes meet through a file store
in a temporary directory (no port).

    python benchmarks/bench_vlm.py                     # both parts (~2 minutes on 2 cores)
    python benchmarks/bench_vlm.py --part bytes --cp-sizes 2 4 8
    python benchmarks/bench_vlm.py --part time --seq-lens 1024 2048 4096 8192 --repeats 5
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import string
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

#: The tiny models (a Qwen2.5-VL from its config file; a Qwen3-VL with the same text model and deepstack levels).
MODELS = ("qwen2_5_vl", "qwen3_vl")


def tiny_config(model_type: str):
    """The tiny config of ``model_type`` (``MODELS``)."""
    import transformers

    with open(ROOT / "configs" / "model" / "tiny-qwen2_5-vl.json", encoding="utf-8") as fh:
        base = json.load(fh)
    if model_type == "qwen2_5_vl":
        return transformers.AutoConfig.for_model(**base)
    text = {**base["text_config"], "model_type": "qwen3_vl_text"}
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
    vision = dict(model_type="qwen3_vl_vision", depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                  in_channels=3, patch_size=4, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64,
                  num_position_embeddings=256, deepstack_visual_indexes=[0, 1])
    tokens = {k: base[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")}
    return transformers.AutoConfig.for_model("qwen3_vl", text_config=text, vision_config=vision, **tokens,
                                             tie_word_embeddings=False)


def row_documents(config, seq_len: int, seed: int, image_share: float = 0.3) -> list[dict]:
    """Image-text documents (the example's generator, text of random letters, lengths lognormal around seq_len / 8)
    that fill one row of ``seq_len`` tokens to at least 90 %, about ``image_share`` of their tokens image placeholders.
    """
    from train_vlm_packed_cp import make_documents

    rng = random.Random(seed)
    texts = ["".join(rng.choice(string.ascii_letters + " ") for _ in range(
        max(8, min(int(rng.lognormvariate(0, 0.8) * seq_len / 8 / 1.4), seq_len // 4)))) for _ in range(64)]
    docs, used = [], 0
    for doc in make_documents(config, texts, seq_len=seq_len, image_share=image_share, text_only_share=0.25,
                              seed=seed, max_images=16):
        if used + len(doc["input_ids"]) <= seq_len:
            docs.append(doc)
            used += len(doc["input_ids"])
        if used >= 0.9 * seq_len:
            return docs
    raise ValueError(f"could not fill a row of {seq_len} tokens")


def _model(config, attn_implementation):
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForImageTextToText.from_config(copy.deepcopy(config),
                                                                attn_implementation=attn_implementation)


# ---- the ranks ------------------------------------------------------------------------------------------------


def _bytes_case(model_type: str, seq_len: int, seed: int, rank: int, world: int) -> dict:
    import torch.distributed as dist
    from train_vlm_packed_cp import ATTN_IMPLEMENTATION

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.model.media import media_stats

    config = tiny_config(model_type)
    model = _model(config, ATTN_IMPLEMENTATION).train()
    docs = row_documents(config, seq_len, seed)
    collator = bd.PackingCollator(seq_len, group=dist.group.WORLD, pad_token_id=config.text_config.pad_token_id,
                                  model_config=model.config)
    batch = collator(docs)
    ctx = batch["cp_context"]
    model(**batch).loss.backward()
    # The formula: who holds each placeholder token (placement) and who encodes each image (plan), nothing else.
    row = torch.cat([docs[d.index]["input_ids"] for d in collator.pack(docs)[0].documents])  # the packed order
    owner = torch.full((seq_len,), -1, dtype=torch.int64)
    for r in range(world):
        owner[ctx.placement.positions(r)] = r
    positions = torch.nonzero(row == config.image_token_id).flatten()
    plan = ctx.media
    encoder = torch.repeat_interleave(torch.tensor(plan.encoder), torch.tensor(plan.rows))
    levels = len(getattr(config.vision_config, "deepstack_visual_indexes", None) or ())
    row_bytes = config.text_config.hidden_size * (1 + levels) * next(model.parameters()).element_size()
    rows_in = int(((owner[positions] == rank) & (encoder != rank)).sum())
    rows_out = int(((owner[positions] != rank) & (encoder == rank)).sum())
    sent, received = rows_out * row_bytes, rows_in * row_bytes
    measured = {phase: (s, r) for phase, s, r in media_stats(ctx).per_call}
    return {"measured": measured, "formula": {"forward": (sent, received), "backward": (received, sent)},
            "images": len(plan.rows), "encoded": len(plan.encode), "levels": levels, "row_bytes": row_bytes,
            "hidden": config.text_config.hidden_size, "rows_in": rows_in, "rows_out": rows_out}


def _time_case(seq_len: int, seed: int, repeats: int, rank: int, world: int) -> dict:
    import torch.distributed as dist
    from train_vlm_packed_cp import ATTN_IMPLEMENTATION

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.model.media import media_stats

    config = tiny_config("qwen2_5_vl")
    model = _model(config, ATTN_IMPLEMENTATION).train()
    docs = row_documents(config, seq_len, seed)
    group = dist.group.WORLD if world > 1 else None
    batch = bd.PackingCollator(seq_len, group=group, pad_token_id=config.text_config.pad_token_id,
                               model_config=model.config)(docs)
    times = []
    for step in range(repeats + 1):
        if group is not None:
            dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        model.zero_grad(set_to_none=True)
        model(**batch).loss.backward()
        cpu = time.process_time() - cpu
        if group is not None:  # a data-parallel gradient all-reduce is not part of the CP cost
            dist.barrier()
        if step:
            times.append((time.perf_counter() - start, cpu))
    ctx = batch["cp_context"]
    media, kv = media_stats(ctx), bd.comm_stats(ctx)  # the context's counts: every step that ran on it
    image_tokens = sum(int((d["input_ids"] == config.image_token_id).sum()) for d in docs)
    steps = repeats + 1
    return {"times": times, "media_bytes": (media.sent_bytes + media.received_bytes) / steps,
            "kv_bytes": (kv.sent_bytes + kv.received_bytes) / steps, "docs": len(docs), "images": sum(
                len(d.get("image_grid_thw", ())) for d in docs), "tokens": sum(len(d["input_ids"]) for d in docs),
            "image_tokens": image_tokens}


def _worker(rank: int, world: int, store_path: str, task: dict, out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    if task["part"] == "bytes":
        out = [_bytes_case(m, task["seq_len"], task["seed"], rank, world) for m in MODELS]
    else:
        out = [_time_case(s, task["seed"], task["repeats"], rank, world) for s in task["seq_lens"]]
    Path(f"{out_path}.{rank}").write_text(json.dumps(out))
    if world > 1:
        from hf_blockdiag_cp.training import close_process_groups

        close_process_groups()


def _run(world: int, task: dict) -> list[list[dict]]:
    """Every rank's results of ``task`` (``world`` 1 runs in this process)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out")
        if world == 1:
            _worker(0, 1, store, task, out)
        else:
            mp.start_processes(_worker, args=(world, store, task, out), nprocs=world, start_method="spawn")
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]


# ---- the parts ------------------------------------------------------------------------------------------------


def bytes_part(args) -> bool:
    print(f"\n## Image feature all-to-all bytes per rank, one training step (S = {args.bytes_seq_len}, fp32, gloo, "
          "balanced placement)\n")
    print("Formula: forward received = rows in x B/row, forward sent = rows out x B/row, backward the reverse;\n"
          "rows in = feature rows of images encoded on another rank whose placeholder tokens this rank holds,\n"
          "rows out = feature rows of images this rank encodes whose placeholder tokens another rank holds,\n"
          "B/row = text hidden x (1 + deepstack levels) x element size.\n")
    print("| model | P | rank | images (encoded here) | rows in | rows out | B/row | fwd sent / received (B) | "
          "bwd sent / received (B) | formula fwd sent / received (B) | equal |")
    print("|---|---:|---:|---|---:|---:|---|---:|---:|---:|---|")
    all_equal = True
    for world in args.cp_sizes:
        per_rank = _run(world, {"part": "bytes", "seq_len": args.bytes_seq_len, "seed": args.seed})
        for m, model_type in enumerate(MODELS):
            for rank in range(world):
                res = per_rank[rank][m]
                fwd, bwd = res["measured"]["forward"], res["measured"]["backward"]
                f_fwd, f_bwd = res["formula"]["forward"], res["formula"]["backward"]
                equal = list(fwd) == list(f_fwd) and list(bwd) == list(f_bwd)
                all_equal &= equal
                per_row = f"{res['hidden']} x {1 + res['levels']} x 4 = {res['row_bytes']}"
                print(f"| {model_type} | {world} | {rank} | {res['images']} ({res['encoded']}) | {res['rows_in']} | "
                      f"{res['rows_out']} | {per_row} | {fwd[0]:,} / {fwd[1]:,} | {bwd[0]:,} / {bwd[1]:,} | "
                      f"{f_fwd[0]:,} / {f_fwd[1]:,} | {'yes' if equal else 'NO'} |", flush=True)
    return all_equal


def time_part(args) -> dict:
    task = {"part": "time", "seq_lens": args.seq_lens, "seed": args.seed, "repeats": args.repeats}
    one = _run(1, task)[0]
    two = _run(2, task)
    print(f"\n## Tiny Qwen2.5-VL training step (fwd+bwd) on one packed row, CP = 1 vs CP = 2 (gloo, one thread per "
          f"rank, balanced placement; median of {args.repeats})\n")
    print("| S | docs | images | image tokens | CP = 1 CPU | CP = 2 CPU busiest / other rank | CPU ratio | "
          "CP = 1 wall | CP = 2 wall | wall ratio | features moved per rank (KiB) | K/V moved per rank (KiB) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    results = {}
    for i, seq_len in enumerate(args.seq_lens):
        steps_two = list(zip(*(two[r][i]["times"] for r in range(2))))
        wall1 = statistics.median(t[0] for t in one[i]["times"])
        cpu1 = statistics.median(t[1] for t in one[i]["times"])
        wall2 = statistics.median(max(r[0] for r in step) for step in steps_two)
        cpu2 = statistics.median(max(r[1] for r in step) for step in steps_two)
        other = statistics.median(min(r[1] for r in step) for step in steps_two)
        media = max(two[r][i]["media_bytes"] for r in range(2)) / 2 ** 10
        kv = max(two[r][i]["kv_bytes"] for r in range(2)) / 2 ** 10
        row = one[i]
        share = row["image_tokens"] / row["tokens"]
        results[seq_len] = {"cpu": (cpu1, cpu2), "wall": (wall1, wall2), "media_kib": media, "kv_kib": kv}
        print(f"| {seq_len:,} | {row['docs']} | {row['images']} | {row['image_tokens']:,} ({100 * share:.0f} %) | "
              f"{cpu1 * 1e3:.0f} ms | {cpu2 * 1e3:.0f} / {other * 1e3:.0f} ms | {cpu2 / cpu1:.2f} | "
              f"{wall1 * 1e3:.0f} ms | {wall2 * 1e3:.0f} ms | {wall2 / wall1:.2f} | {media:.1f} | {kv:.1f} |",
              flush=True)
    return results


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib is not installed: no plot; pip install -e \".[bench]\" for {path})")
        return
    lens = sorted(results)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for key, style in (("cpu", "-"), ("wall", "--")):
        for cp, colour in ((0, "tab:blue"), (1, "tab:orange")):
            left.plot(lens, [results[s][key][cp] * 1e3 for s in lens], style, marker="o", color=colour,
                      label=f"CP = {cp + 1} {'wall' if key == 'wall' else 'CPU (busiest rank)' if cp else 'CPU'}")
    left.set(xlabel="row tokens S", ylabel="ms per step (fwd+bwd)", title="tiny Qwen2.5-VL step", xscale="log")
    left.legend(fontsize=8)
    right.plot(lens, [results[s]["media_kib"] for s in lens], marker="o", label="image features (all-to-all)")
    right.plot(lens, [results[s]["kv_kib"] for s in lens], marker="s", label="K/V exchange")
    right.set(xlabel="row tokens S", ylabel="KiB per rank per step (fwd+bwd)", title="CP = 2: bytes moved",
              xscale="log")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["bytes", "time", "both"], default="both",
                        help="bytes: feature all-to-all bytes vs the formula; time: CP = 2 vs CP = 1 step; both")
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4], help="--part bytes: CP sizes (gloo ranks)")
    parser.add_argument("--bytes-seq-len", type=int, default=2048, help="--part bytes: row tokens (default 2048)")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192],
                        help="--part time: row lengths (default 1024 2048 4096 8192)")
    parser.add_argument("--repeats", type=int, default=5, help="--part time: timed steps after a warm-up, median")
    parser.add_argument("--seed", type=int, default=0, help="seed of the documents (the weights use seed 0)")
    parser.add_argument("--out", default="bench_vlm.png",
                        help="the plot of --part time (needs matplotlib); '' for none")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    ok = True
    if args.part in ("bytes", "both"):
        ok = bytes_part(args)
        print(f"\nmeasured == formula on every rank: {'yes' if ok else 'NO'}")
    if args.part in ("time", "both"):
        results = time_part(args)
        if args.out:
            plot(results, args.out)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
