"""One random case per recurrent op, shared by the op tests: inputs, how to run the chunked op and its
float64 reference, and which inputs are differentiable."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hf_blockdiag_cp.recurrent import ops

CHUNK = 8
CONV_WIDTH = 4
# several sequences: empty, single tokens, shorter than the conv window, exact chunk multiples, up to 3 chunks
LENS = [5, 1, 17, 0, 2, 24, 9, 3, 8]


def cu_of(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


@dataclass
class Case:
    name: str
    inputs: dict[str, torch.Tensor]  # token-aligned tensors are [1, T, ...]; dim 1 is time
    params: dict[str, torch.Tensor]  # per-layer tensors (no time dim)
    state_shape: tuple[int, ...]  # per sequence
    run: Callable  # run(inputs, params, initial_state, cu_seqlens, output_final_state) -> (out, final)
    ref: Callable  # ref(inputs, params, initial_state, cu_seqlens) -> (out, final) in fp64
    time_inputs: tuple[str, ...] = ()

    def cast(self, dtype: torch.dtype, requires_grad: bool = False) -> "Case":
        conv = lambda t: t.detach().to(dtype).requires_grad_(requires_grad)  # noqa: E731
        return Case(self.name, {k: conv(v) for k, v in self.inputs.items()},
                    {k: conv(v) for k, v in self.params.items()}, self.state_shape, self.run, self.ref)

    def leaves(self) -> dict[str, torch.Tensor]:
        return {**self.inputs, **self.params}

    def slice_time(self, lo: int, hi: int) -> dict[str, torch.Tensor]:
        return {k: v[:, lo:hi] for k, v in self.inputs.items()}


def _conv(total: int, gen: torch.Generator) -> Case:
    channels = 6
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return Case(
        "causal_conv1d", {"x": r(1, total, channels)}, {"weight": r(channels, CONV_WIDTH), "bias": r(channels)},
        (channels, CONV_WIDTH - 1),
        run=lambda i, p, s0, cu, fs: ops.causal_conv1d(i["x"], p["weight"], p["bias"], "silu", initial_state=s0,
                                                        output_final_state=fs, cu_seqlens=cu),
        ref=lambda i, p, s0, cu: ops.causal_conv1d_reference(i["x"], p["weight"], p["bias"], "silu",
                                                              initial_state=s0, cu_seqlens=cu),
    )


def _ssd(total: int, gen: torch.Generator) -> Case:
    heads, head_dim, groups, state = 4, 3, 2, 5
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    kw = dict(dt_softplus=True, dt_limit=(0.001, 5.0), chunk_size=CHUNK)
    return Case(
        "ssd_chunk_scan",
        {"x": r(1, total, heads, head_dim), "dt": r(1, total, heads), "B": r(1, total, groups, state),
         "C": r(1, total, groups, state)},
        {"A": -(u(heads) * 3 + 0.1), "D": r(heads), "dt_bias": r(heads)}, (heads, head_dim, state),
        run=lambda i, p, s0, cu, fs: ops.ssd_chunk_scan(
            i["x"], i["dt"], p["A"], i["B"], i["C"], D=p["D"], dt_bias=p["dt_bias"], initial_state=s0,
            output_final_state=fs, cu_seqlens=cu, **kw),
        ref=lambda i, p, s0, cu: ops.ssd_chunk_scan_reference(
            i["x"], i["dt"], p["A"], i["B"], i["C"], D=p["D"], dt_bias=p["dt_bias"], dt_softplus=True,
            dt_limit=(0.001, 5.0), initial_state=s0, cu_seqlens=cu),
    )


def _delta(total: int, gen: torch.Generator, per_channel: bool) -> Case:
    k_heads, heads, dk, dv = 2, 4, 4, 3
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    g_shape = (1, total, heads, dk) if per_channel else (1, total, heads)
    op = ops.chunk_kda if per_channel else ops.chunk_gated_delta_rule
    return Case(
        "chunk_kda" if per_channel else "chunk_gated_delta_rule",
        {"q": r(1, total, k_heads, dk), "k": r(1, total, k_heads, dk), "v": r(1, total, heads, dv),
         "g": -u(*g_shape) * 1.5, "beta": u(1, total, heads)},
        {}, (heads, dk, dv),
        run=lambda i, p, s0, cu, fs: op(i["q"], i["k"], i["v"], i["g"], i["beta"], initial_state=s0,
                                        output_final_state=fs, cu_seqlens=cu, use_qk_l2norm_in_kernel=True,
                                        chunk_size=CHUNK),
        ref=lambda i, p, s0, cu: ops.delta_rule_reference(i["q"], i["k"], i["v"], i["g"], i["beta"],
                                                          initial_state=s0, cu_seqlens=cu,
                                                          use_qk_l2norm_in_kernel=True),
    )


def _mamba1(total: int, gen: torch.Generator) -> Case:
    channels, state = 5, 4
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return Case(
        "selective_scan",
        {"u": r(1, total, channels), "delta": r(1, total, channels), "B": r(1, total, state),
         "C": r(1, total, state), "z": r(1, total, channels)},
        {"A": -(u(channels, state) * 3 + 0.1), "D": r(channels), "delta_bias": r(channels)}, (channels, state),
        run=lambda i, p, s0, cu, fs: ops.selective_scan(
            i["u"], i["delta"], p["A"], i["B"], i["C"], p["D"], i["z"], p["delta_bias"], True, initial_state=s0,
            output_final_state=fs, cu_seqlens=cu, chunk_size=CHUNK),
        ref=lambda i, p, s0, cu: ops.selective_scan_reference(
            i["u"], i["delta"], p["A"], i["B"], i["C"], p["D"], i["z"], p["delta_bias"], True, initial_state=s0,
            cu_seqlens=cu),
    )


OPS = ["causal_conv1d", "ssd_chunk_scan", "chunk_gated_delta_rule", "chunk_kda", "selective_scan"]


def make_case(name: str, total: int, seed: int = 0) -> Case:
    gen = torch.Generator().manual_seed(seed)
    return {
        "causal_conv1d": lambda: _conv(total, gen),
        "ssd_chunk_scan": lambda: _ssd(total, gen),
        "chunk_gated_delta_rule": lambda: _delta(total, gen, False),
        "chunk_kda": lambda: _delta(total, gen, True),
        "selective_scan": lambda: _mamba1(total, gen),
    }[name]()


def random_state(case: Case, n: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, *case.state_shape, generator=gen, dtype=torch.float64).to(dtype)
