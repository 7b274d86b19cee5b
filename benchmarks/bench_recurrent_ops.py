"""Speed of the chunked recurrent ops on a packed row vs transformers' own torch fallback (issue 24, CPU).

For each op, one packed row of ``--tokens`` tokens made of ``--docs`` lognormal documents runs through the package's
chunked op with ``cu_seqlens`` (every document restarts), and the same tokens run as ONE unpacked sequence through
the function transformers calls when no kernel library is installed (which cannot reset at document starts, so it
is the cost floor the acceptance compares against: ratio <= 1.5). Forward + backward (every input requires grad),
one thread, median of ``--repeats`` after one warm-up. Tiny head sizes, like the test configs.

transformers' Mamba1 fallback (``mamba_selective_scan``) indexes one token per step out of full-length tensors,
so its backward is quadratic in the length (about 10 s at 2K tokens, hours at 16K): time ``mamba1`` with
``--forward-only`` at 16K, or fwd+bwd with ``--tokens 2048``.

    python benchmarks/bench_recurrent_ops.py                      # 16K tokens, 8 docs, all ops
    python benchmarks/bench_recurrent_ops.py --tokens 4096 --ops ssd gdn --forward-only
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hf_blockdiag_cp.recurrent import ops  # noqa: E402


def lognormal_lengths(total: int, docs: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.empty(docs).log_normal_(0.0, 1.0, generator=gen)
    lens = [max(1, int(x)) for x in (w / w.sum() * total).tolist()]
    lens[lens.index(max(lens))] += total - sum(lens)
    return lens


def _inputs(op: str, total: int, gen: torch.Generator) -> dict:
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen)  # noqa: E731
    if op == "conv":
        return {"x": r(1, total, 256), "w": r(256, 4), "b": r(256)}
    if op == "ssd":
        h, p, g, n = 8, 16, 1, 16
        return {"x": r(1, total, h, p), "dt": r(1, total, h), "A": -(u(h) * 4 + 0.5), "B": r(1, total, g, n),
                "C": r(1, total, g, n), "D": r(h), "dt_bias": r(h)}
    if op in ("gdn", "kda"):
        hk, h, dk, dv = (2, 4, 32, 32) if op == "gdn" else (4, 4, 32, 32)
        g_shape = (1, total, h) if op == "gdn" else (1, total, h, dk)
        return {"q": r(1, total, hk, dk), "k": r(1, total, hk, dk), "v": r(1, total, h, dv),
                "g": -u(*g_shape) * 0.5, "beta": u(1, total, h)}
    if op == "mamba1":
        d, n = 128, 16
        return {"u": r(1, total, d), "delta": r(1, total, d), "A": -(u(d, n) * 4 + 0.5), "B": r(1, total, n),
                "C": r(1, total, n), "D": r(d), "z": r(1, total, d), "delta_bias": r(d)}
    raise ValueError(op)


def _ours(op: str, t: dict, cu: torch.Tensor, lens: list[int]):
    kw = dict(cu_seqlens=cu, seq_lens_host=lens, output_final_state=True)
    if op == "conv":
        return ops.causal_conv1d(t["x"], t["w"], t["b"], "silu", **kw)
    if op == "ssd":
        return ops.ssd_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], D=t["D"], dt_bias=t["dt_bias"],
                                  dt_softplus=True, chunk_size=256, **kw)
    if op == "gdn":
        return ops.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], use_qk_l2norm_in_kernel=True,
                                          chunk_size=64, **kw)
    if op == "kda":
        return ops.chunk_kda(t["q"], t["k"], t["v"], t["g"], t["beta"], use_qk_l2norm_in_kernel=True, chunk_size=64,
                             **kw)
    return ops.selective_scan(t["u"], t["delta"], t["A"], t["B"], t["C"], t["D"], t["z"], t["delta_bias"], True,
                              chunk_size=64, **kw)


def _theirs(op: str, t: dict):
    """transformers 5.25's torch fallbacks, called as the models call them, on the row as one sequence."""
    from transformers.models.bamba import modeling_bamba
    from transformers.models.kimi_linear import modeling_kimi_linear
    from transformers.models.mamba import modeling_mamba
    from transformers.models.qwen3_next import modeling_qwen3_next
    if op == "conv":  # channels first in and out, transposed back as the layers do (`mixed_qkv.transpose(1, 2)`)
        y = modeling_qwen3_next.causal_conv1d_fn(t["x"].transpose(1, 2), t["w"], t["b"], activation="silu")
        return y.transpose(1, 2), None
    if op == "ssd":
        return modeling_bamba.mamba2_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=256, D=t["D"],
                                                dt_bias=t["dt_bias"], dt_softplus=True, return_final_states=True)
    if op == "gdn":
        return modeling_qwen3_next.torch_chunk_gated_delta_rule(
            t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], chunk_size=64, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
    if op == "kda":
        return modeling_kimi_linear.chunk_kimi_delta_attention(
            t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], chunk_size=64, output_final_state=True,
            use_qk_l2norm_in_kernel=True)
    tr = lambda x: x.transpose(1, 2)  # noqa: E731
    return modeling_mamba.mamba_selective_scan(tr(t["u"]), tr(t["delta"]), t["A"], tr(t["B"]), tr(t["C"]),
                                               D=t["D"], z=tr(t["z"]), delta_bias=t["delta_bias"],
                                               delta_softplus=True, return_last_state=True)


def _time(fn, inputs: dict, backward: bool, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):
        leaves = {k: v.detach().requires_grad_(backward) for k, v in inputs.items()}
        start = time.perf_counter()
        out, final = fn(leaves)
        if backward:
            loss = out.float().square().mean() + (0 if final is None else final.float().square().mean())
            loss.backward()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens in the packed row (default 16384)")
    parser.add_argument("--docs", type=int, default=8, help="lognormal documents in the row (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per op, median reported (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the lengths and inputs")
    parser.add_argument("--forward-only", action="store_true", help="time the forward only (no backward)")
    parser.add_argument("--ops", nargs="+", default=["conv", "ssd", "gdn", "kda", "mamba1"],
                        choices=["conv", "ssd", "gdn", "kda", "mamba1"], help="ops to time (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import transformers
    transformers.logging.set_verbosity_error()
    lens = lognormal_lengths(args.tokens, args.docs, args.seed)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    backward = not args.forward_only
    print(f"# {args.tokens} tokens, docs {lens}, {'fwd+bwd' if backward else 'fwd'}, 1 thread, "
          f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"| op | ours, packed ({args.docs} docs) | transformers fallback, 1 sequence | ratio |")
    print("|---|---|---|---|")
    for op in args.ops:
        inputs = _inputs(op, args.tokens, torch.Generator().manual_seed(args.seed))
        ours = _time(lambda t: _ours(op, t, cu, lens), inputs, backward, args.repeats)
        theirs = _time(lambda t: _theirs(op, t), inputs, backward, args.repeats)
        print(f"| {op} | {ours * 1e3:.1f} ms | {theirs * 1e3:.1f} ms | {ours / theirs:.2f} |", flush=True)


if __name__ == "__main__":
    main()
