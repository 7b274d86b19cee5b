"""What a hybrid model's recurrent layers cost a placement: the state summaries its cut documents exchange.

Every fragment of a document that a later fragment follows sends one summary of ``W`` fp32 floats per recurrent
layer (``hf_blockdiag_cp/recurrent/README.md``); every rank sends ``slots`` of them (the most any rank has), so
one layer's all-gather moves, per rank and direction::

    bytes per layer per rank = (P - 1) * slots * W * 4

:func:`recurrent_shape` reads ``(recurrent layers, W)`` and the attention geometry off a model config (the known
hybrid families; anything else has no recurrent cost), :func:`summary_slots` counts ``slots`` of a placement from
its runs (equal to :func:`~.fragments.plan_fragments`'s, without building the plan). Pure host arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .placement import Placement

__all__ = ["RecurrentShape", "recurrent_bytes", "recurrent_shape", "summary_slots"]


@dataclass(frozen=True)
class RecurrentShape:
    """A hybrid model's sizes for the placement cost model.

    Attributes:
        family: ``"gdn"``, ``"ssd"``, ``"mamba1"`` or ``"conv"`` (the summary formula used).
        layers: recurrent layers (one layer = its causal convolution and its scan, one summary each fragment).
        width: ``W``, fp32 floats of one fragment's summaries in one layer (conv window + scan state + transition).
        attention_layers: full-attention layers (their causal work is what the balance serves).
        q_heads / head_dim / value_dim: their query heads and widths (FLOPs per query-key pair).
    """

    family: str
    layers: int
    width: int
    attention_layers: int
    q_heads: int
    head_dim: int
    value_dim: int


def recurrent_bytes(shape: RecurrentShape, cp_size: int, slots: int) -> int:
    """Bytes one recurrent layer's summary all-gather moves per rank, forward: ``(P - 1) * slots * W * 4``."""
    return (cp_size - 1) * slots * shape.width * 4


def _count(types: Any, names: tuple[str, ...]) -> int:
    return sum(1 for t in types or () if t in names)


def _gdn_width(c: Any) -> int:
    # Conv window C (K - 1) with C = 2 Hk Dk + Hv Dv; scan end state Hv Dk Dv and transition Hv Dk Dk.
    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    return (2 * hk * dk + hv * dv) * (c.linear_conv_kernel_dim - 1) + hv * dk * dv + hv * dk * dk


def _ssd_width(heads: int, head_dim: int, groups: int, state: int, kernel: int) -> int:
    # Conv window C (K - 1) with C = H P + 2 G N; scan end state H P N and one decay per head.
    return (heads * head_dim + 2 * groups * state) * (kernel - 1) + heads * head_dim * state + heads


def _recurrent_part(c: Any) -> tuple[str, int, int, int] | None:
    """``(family, recurrent layers, W, attention layers)`` of a known hybrid config, else ``None``."""
    kind = getattr(c, "model_type", None)
    n = c.num_hidden_layers
    if kind in ("qwen3_next", "qwen3_5", "qwen3_5_text"):
        return ("gdn", _count(c.layer_types, ("linear_attention",)), _gdn_width(c),
                _count(c.layer_types, ("full_attention",)))
    if kind == "nemotron_h":
        pattern = c.hybrid_override_pattern
        return "ssd", pattern.count("M"), _ssd_width(c.mamba_num_heads, c.mamba_head_dim, c.n_groups,
                                                      c.ssm_state_size, c.conv_kernel), pattern.count("*")
    if kind in ("bamba", "falcon_h1", "granitemoehybrid"):
        if kind == "falcon_h1":  # every layer runs attention and Mamba2 side by side
            layers, attention = n, n
        elif kind == "granitemoehybrid":
            layers = _count(c.layer_types, ("mamba",))
            attention = n - layers
        else:
            attention = len(c.attn_layer_indices or ())
            layers = n - attention
        heads, head_dim = c.mamba_n_heads, c.mamba_d_head
        if head_dim in (None, "auto"):
            head_dim = c.mamba_expand * c.hidden_size // heads
        return "ssd", layers, _ssd_width(heads, head_dim, c.mamba_n_groups, c.mamba_d_state, c.mamba_d_conv), attention
    if kind == "jamba":
        # Mamba1: end state [D, N] and its decay exp(A sum delta) [D, N]; conv window D (K - 1).
        d = c.mamba_expand * c.hidden_size
        attention = _count(c.layers_block_type, ("attention",))
        return "mamba1", n - attention, 2 * d * c.mamba_d_state + d * (c.mamba_d_conv - 1), attention
    if kind == "lfm2":
        # A short convolution keeps its last L_cache - 1 inputs of the hidden width.
        layers = _count(c.layer_types, ("conv",))
        return "conv", layers, c.hidden_size * (c.conv_L_cache - 1), n - layers
    return None


def recurrent_shape(config: Any) -> RecurrentShape | None:
    """The :class:`RecurrentShape` of a model config (or a model), ``None`` for a model without recurrent layers the
    cost model knows (its placement is then chosen as before)."""
    c = getattr(config, "config", config)
    c = getattr(c, "text_config", None) or c  # a multimodal wrapper: the language model's layers
    try:
        part = _recurrent_part(c)
    except (AttributeError, TypeError):  # a config variant without the fields: no recurrent cost, as unknown
        return None
    if part is None or part[1] == 0:
        return None
    family, layers, width, attention = part
    q_heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // q_heads
    return RecurrentShape(family, layers, width, attention, q_heads, head_dim, head_dim)


def summary_slots(doc_ids_row: torch.Tensor, placement: Placement) -> int:
    """``slots`` of ``placement`` over the row ``doc_ids_row [S]``: the most fragments one rank holds that a later
    fragment of their document follows (:func:`~.fragments.plan_fragments` gives the same, from the runs here)."""
    ids = doc_ids_row.to(torch.int64).reshape(-1).numpy()
    full_len = ids.size
    if full_len == 0 or placement.cp_size == 1:
        return 0
    runs = placement.runs
    doc_start = np.concatenate([[0], np.flatnonzero(ids[1:] != ids[:-1]) + 1]).astype(np.int64)
    cuts = np.union1d(runs.start, doc_start)
    ends = np.append(cuts[1:], full_len)
    # A piece sends when the next piece starts inside its document (its end is no document boundary).
    boundary = np.zeros(full_len + 1, dtype=bool)
    boundary[doc_start] = True
    boundary[full_len] = True
    sends = (ids[cuts] != 0) & ~boundary[ends]
    owner = runs.rank[np.searchsorted(runs.start, cuts, side="right") - 1]
    return int(np.bincount(owner[sends], minlength=placement.cp_size).max())
