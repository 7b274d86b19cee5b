"""Sparse-indexer attention (DeepSeek-V3.2 DSA): peak memory on CPU, and bytes exchanged per token per layer under CP.

Part 1 (measured): one training step (forward + backward) of a tiny one-layer ``deepseek_v32`` (hidden 64, 4 heads,
MLA latent 32 + rope 8, indexer 4 heads x 16) on a row of ``--tokens`` (default 32768) tokens holding one document,
``index_topk = 64``, served by ``blockdiag_cp`` (running top-k over key blocks, attention over the selected keys), vs
the same model and sizes without an indexer (``deepseek_v3``: the same MLA with plain block-diagonal attention). Also
the attention op alone: the served indexer's selection plus the sparse attention, vs the plain block-diagonal kernel,
on the same q / k / v. Each case runs in a fresh process; the peak is that process's resident-set high-water mark
during the step minus its resident set before it (``/proc/self/clear_refs``), fp32, one thread, with glibc's
``MALLOC_MMAP_THRESHOLD_=65536`` in both (blocks of 64 KiB and more are mapped and unmapped, so the mark follows the
live tensors, not what the heap kept of freed ones: without it the sparse path's many chunk-sized blocks fragment the
heap and the mark counts them again).

Part 2 (arithmetic): values one rank receives per remote token per layer under CP: the MLA latent and rope key
(with gradient) plus, on layers with their own indexer, the indexer key (no gradient), vs the expanded K/V the
dense path would move; at DeepSeek-V3.2 and GLM-5 sizes (transformers' config defaults). tests/sparse/test_cp.py
checks that the bytes the exchange moves equal this formula.

    python benchmarks/bench_sparse.py                  # both parts, 32K tokens
    python benchmarks/bench_sparse.py --tokens 8192    # a quicker run
    python benchmarks/bench_sparse.py --no-measure     # arithmetic only
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MIB = 2 ** 20
CASES = ("model-sparse", "model-plain", "op-sparse", "op-plain")
MLA_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
              "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "intermediate_size", "vocab_size")


def _status() -> dict[str, int]:
    text = open("/proc/self/status").read()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}


def _config(model_type: str, topk: int):
    from hf_blockdiag_cp.conformance.configs import tiny_config

    sparse = copy.deepcopy(tiny_config("deepseek_v32"))
    sparse.index_topk, sparse.num_hidden_layers = topk, 1
    if model_type == "deepseek_v32":
        return sparse
    plain = copy.deepcopy(tiny_config("deepseek_v3"))
    for name in MLA_FIELDS:
        setattr(plain, name, getattr(sparse, name))
    plain.num_hidden_layers, plain.first_k_dense_replace = 1, 1
    return plain


def _model_step(model_type: str, tokens: int, topk: int):
    """Return a closure running one forward + backward of the model on one ``tokens``-long document."""
    import torch

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.conformance.runs import build_model

    model = build_model(_config(model_type, topk), "blockdiag_cp")
    model.train()
    gen = torch.Generator().manual_seed(0)
    doc = torch.randint(3, 250, (tokens,), generator=gen)
    batch = bd.PackingCollator(tokens, pad_token_id=0)([{"input_ids": doc.tolist()}])

    def step() -> None:
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], cp_context=batch["cp_context"],
                    use_cache=False)
        torch.nn.functional.cross_entropy(out.logits[0], batch["shift_labels"][0], ignore_index=-100).backward()
    return step


def _op_step(sparse: bool, tokens: int, topk: int):
    """The attention op alone on the tiny config's shapes: selection + sparse attention, or the plain kernel."""
    import torch

    from hf_blockdiag_cp.attention.core import attend_flat
    from hf_blockdiag_cp.planning import build_varlen_plan
    from hf_blockdiag_cp.sparse import document_topk, query_bounds, sparse_attention

    cfg = _config("deepseek_v32", topk)
    heads, dk, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(tokens, heads, dk, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(tokens, heads, dv, generator=gen, requires_grad=True)
    iq = torch.randn(tokens, cfg.index_n_heads, cfg.index_head_dim, generator=gen)
    ik = torch.randn(tokens, cfg.index_head_dim, generator=gen)
    iw = torch.randn(tokens, cfg.index_n_heads, generator=gen)
    plan = build_varlen_plan(torch.ones(tokens, dtype=torch.int32))
    scale = dk ** -0.5

    def step() -> None:
        if sparse:
            indices = document_topk(iq, ik, iw, cfg.index_head_dim ** -0.5, topk)[None]
            out = sparse_attention(q, k, v, indices, query_bounds(plan, q.device), scale=scale)
        else:
            out = attend_flat(q, k, v, plan, "sdpa_doc", scale=scale)
        out.sum().backward()
    return step


def worker(case: str, tokens: int, topk: int) -> dict[str, float]:
    """Run one case in this process: ``{"peak_mib", "seconds"}``."""
    import gc

    import torch

    torch.set_num_threads(1)
    kind, path = case.split("-")
    if kind == "model":
        step = _model_step("deepseek_v32" if path == "sparse" else "deepseek_v3", tokens, topk)
    else:
        step = _op_step(path == "sparse", tokens, topk)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark to the current resident set
        f.write("5")
    before = _status()["VmRSS"]
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return {"peak_mib": (_status()["VmHWM"] - before) / MIB, "seconds": seconds}


def measure(tokens: int, topk: int) -> None:
    results = {}
    for case in CASES:
        out = subprocess.run([sys.executable, __file__, "--worker", case, "--tokens", str(tokens), "--topk", str(topk)],
                             capture_output=True, text=True, check=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536"})
        results[case] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"Part 1: one forward + backward, {tokens} tokens in one document, index_topk {topk}, fp32, 1 thread\n")
    print("| what | path | peak over the step (MiB) | time (s) | peak vs plain |")
    print("|---|---|---|---|---|")
    for kind, label in (("model", "tiny deepseek_v32, 1 layer"), ("op", "attention op (q / k / v of that layer)")):
        plain = results[f"{kind}-plain"]
        for path in ("plain", "sparse"):
            r = results[f"{kind}-{path}"]
            name = {"plain": "plain block-diagonal" + (" (deepseek_v3, no indexer)" if kind == "model" else ""),
                    "sparse": "served indexer + sparse attention"}[path]
            print(f"| {label} | {name} | {r['peak_mib']:.0f} | {r['seconds']:.1f} | "
                  f"{r['peak_mib'] / plain['peak_mib']:.2f}x |")
    print()


def exchange_table() -> None:
    from transformers import DeepseekV32Config, GlmMoeDsaConfig

    print("Part 2: values one rank receives per remote token per layer under CP (forward; backward returns the "
          "latent's gradient, the same count)\n")
    print("formula: latent = kv_lora_rank + qk_rope_head_dim (with grad) + index_head_dim (indexer key, no grad, "
          "full layers only); expanded K/V = num_heads * (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)\n")
    print("| model | latent + rope | + indexer key | sparse path | expanded K/V (dense path) | ratio |")
    print("|---|---|---|---|---|---|")
    for name, cfg in (("DeepSeek-V3.2", DeepseekV32Config()), ("GLM-5 (glm_moe_dsa)", GlmMoeDsaConfig())):
        latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        sparse = latent + cfg.index_head_dim
        dense = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
        print(f"| {name} | {latent} | {cfg.index_head_dim} | {sparse} ({latent} on a shared layer) | {dense} | "
              f"{dense / sparse:.0f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768, help="tokens of the row (one document)")
    parser.add_argument("--topk", type=int, default=64, help="index_topk of the sparse model")
    parser.add_argument("--no-measure", action="store_true", help="print the exchange arithmetic only")
    parser.add_argument("--worker", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.tokens, args.topk)))
        return
    if not args.no_measure:
        measure(args.tokens, args.topk)
    exchange_table()


if __name__ == "__main__":
    main()
