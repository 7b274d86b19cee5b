"""Issue 18: one attention layer through the registered ``blockdiag_cp`` function under a head-parallel
layout, on P = 4 gloo ranks (u = 4, and u = 2 x c = 2 with the K/V exchange between groups): outputs and
gradients (q, k, v, and the attention sinks summed over ranks) equal the float64 brute-force reference
on the full row. Covers gpt-oss-style sinks (``s_aux`` sliced per head), an MLA-shaped layer
(``Dv != D``), GQA with ``Hkv < u``, sliding windows, softcap, and bf16 autocast (within bf16 rounding).
"""

from __future__ import annotations

import pytest

from tests.launch import run_ranks

pytestmark = pytest.mark.distributed

WORLD = 4
# (name, u, Hq, Hkv, D, Dv, window, softcap, sinks, bf16 autocast)
SCENARIOS = [
    ("u2c2_sinks_gqa", 2, 4, 1, 8, 8, None, None, True, False),
    ("u4_mla_window", 4, 4, 2, 8, 4, 5, None, False, False),
    ("u2c2_softcap_window_mla_sinks", 2, 4, 2, 8, 6, 7, 20.0, True, False),
    ("u4_gqa_bf16_autocast", 4, 8, 2, 8, 8, None, None, False, True),
]


def _row():
    import torch

    lengths = [7, 1, 23, 5]  # crosses rank and group boundaries; 4 padding tokens at the end
    ids = [d + 1 for d, n in enumerate(lengths) for _ in range(n)]
    return torch.tensor(ids + [0] * (40 - len(ids)))


def _worker(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.integration import blockdiag_cp_attention
    from hf_blockdiag_cp.planning.layout import HeadShape
    from tests.reference import dense_reference

    groups = bd.ulysses_groups(None, (2, 4), config=bd.BlockDiagCPConfig(collective_timeout_s=60))
    row = _row()
    full = row.numel()
    module = torch.nn.Module()
    results = {}
    for name, u, hq, hkv, d, dv, window, softcap, with_sinks, bf16 in SCENARIOS:
        gen = torch.Generator().manual_seed(11)
        q, k = (torch.randn(1, h, full, d, generator=gen) for h in (hq, hkv))
        v = torch.randn(1, hkv, full, dv, generator=gen)
        sinks = torch.randn(hq, generator=gen) if with_sinks else None
        upstream = torch.randn(1, full, hq, dv, generator=gen)
        ref_in = [t.double().requires_grad_() for t in (q, k, v)] + ([sinks.double().requires_grad_()] if with_sinks
                                                                     else [])
        ref = dense_reference(*ref_in[:3], row, window=window, softcap=softcap, sinks=ref_in[3] if with_sinks else None)
        ref = ref.transpose(1, 2)  # [1, S, Hq, Dv]
        ref_grads = torch.autograd.grad(ref, ref_in, upstream.double())

        ctx = bd.BlockDiagCPContext.build(
            row, cp_rank=rank, cp_size=world, group=dist.group.WORLD, heads=HeadShape(hq, hkv, d, dv),
            config=bd.BlockDiagCPConfig(ulysses_size=u, collective_timeout_s=60), ulysses_groups=groups,
            sliding_windows=(window,))
        idx = ctx.local_index
        local = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
        mine_sinks = sinks.clone().requires_grad_() if with_sinks else None
        extra = {"s_aux": mine_sinks} if with_sinks else {}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out, _ = blockdiag_cp_attention(module, *local, None, scaling=d ** -0.5, sliding_window=window,
                                            softcap=softcap, cp_context=ctx, **extra)
        inputs = local + ([mine_sinks] if with_sinks else [])
        grads = list(torch.autograd.grad(out, inputs, upstream[:, idx].to(out.dtype)))
        if with_sinks:
            dist.all_reduce(grads[3])  # every rank's queries contributed to its heads' sinks
        errors = [(out.double() - ref[:, idx]).abs().max().item()]
        errors += [(g.double() - r[:, :, idx]).abs().max().item() for g, r in zip(grads[:3], ref_grads[:3])]
        if with_sinks:
            errors.append((grads[3].double() - ref_grads[3]).abs().max().item())
        results[name] = dict(errors=errors, dtype=str(out.dtype), u=ctx.ulysses_size,
                             strategy=str(ctx.exchange.strategy), ref_norm=ref.abs().max().item())
    return results


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ulysses_layer_is_exact_with_sinks_mla_softcap_and_autocast():
    per_rank = run_ranks(_worker, WORLD, timeout=360)
    for rank, results in enumerate(per_rank):
        for name, u, *_, bf16 in SCENARIOS:
            r = results[name]
            assert r["u"] == u and r["ref_norm"] > 0.1, (rank, name)
            bound = 5e-2 if bf16 else 1e-5  # bf16: a few bf16 ulps of O(1) values
            assert max(r["errors"]) < bound, f"rank {rank} {name}: out/dq/dk/dv(/dsinks) errors {r['errors']}"
            assert r["dtype"] == ("torch.bfloat16" if bf16 else "torch.float32"), (rank, name)
    assert any(per_rank[r]["u2c2_sinks_gqa"]["strategy"] != "none" for r in range(WORLD))
