"""``flex``: ``torch.nn.attention.flex_attention`` with a document ``BlockMask`` over the packed rows.

The block mask is built once per plan, window and device (kept in the call's ``schedules``). Compiled
on CUDA; eager elsewhere. On CPU torch 2.13 has no flex backward, so the backend reports itself
unavailable for calls that need gradients there and ``"auto"`` never picks it. Supports logit
softcapping through a ``score_mod``.
"""

from __future__ import annotations

import functools

import torch

from ._imports import optional_import
from .base import Capabilities, KernelCall, reject_unsupported, token_coordinates, visible

NAME = "flex"
MODULE = "torch.nn.attention.flex_attention"


CAPABILITIES = Capabilities(NAME, "flex_attention", module=MODULE, devices=("cuda", "cpu"), cpu_backward=False,
                            dropout=False, sinks=False, last_resort=0)


@functools.lru_cache(maxsize=2)
def _flex_fn(device_type: str):
    flex, _ = optional_import(MODULE)
    # Compiled with static shapes on CUDA (a dynamic recompile per new length is what fails on CPU).
    return torch.compile(flex.flex_attention, dynamic=False) if device_type == "cuda" else flex.flex_attention


def _block_mask(call: KernelCall):
    return call.schedules.get(NAME, call.window, lambda: _build_block_mask(call))


def _build_block_mask(call: KernelCall):
    flex, _ = optional_import(MODULE)
    plan, window = call.plan, call.window
    q_seg, q_pos, k_seg, k_pos = token_coordinates(call)

    def mask_mod(b, h, q_idx, kv_idx):
        return visible(q_seg[q_idx], q_pos[q_idx], k_seg[kv_idx], k_pos[kv_idx], window)

    return flex.create_block_mask(mask_mod, None, None, plan.total_q, plan.total_k, device=plan.device)


def _softcap_mod(cap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)

    return score_mod


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: KernelCall) -> torch.Tensor:
    reject_unsupported(call, NAME, softcap=True)
    score_mod = None if call.softcap is None else _softcap_mod(float(call.softcap))

    out = _flex_fn(q.device.type)(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                  v.transpose(0, 1).unsqueeze(0), score_mod=score_mod, block_mask=_block_mask(call),
                                  scale=call.scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)
