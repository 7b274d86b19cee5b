"""A pure-PyTorch stand-in for ``transformer_engine.pytorch.DotProductAttention`` (``thd`` layout).

Implements the documented contract for ``qkv_format="thd"``: ``query [t, Hq, D]``, ``key/value
[t, Hg, D]`` (``Hg = num_gqa_groups``), int32 ``cu_seqlens_q/kv``, output ``[t, Hq * D]``. Mask
types ``padding`` (no causal), ``padding_causal`` (top-left diagonal) and
``padding_causal_bottom_right`` (diagonal at key ``i + Sk - Sq``); ``window_size=(left, right)``
around that diagonal, ``-1`` unbounded; causal masks need ``right == 0``. Default scale
``kv_channels ** -0.5``.

Stricter than TE: ``max_seqlen_q/kv`` must be given and be the exact maxima, ``cu_seqlens`` are
fully checked. Deviations on purpose: float32/float64 accepted and CPU tensors allowed; other
formats, biases, dropout and context parallelism raise ``NotImplementedError``.

Constructions and forward calls are recorded in the module's ``constructions`` and ``calls``
lists; a fresh pair of modules (``transformer_engine`` and ``transformer_engine.pytorch``) per test
comes from :func:`make_modules`.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from ._contract import check_cu_seqlens
from ._math import segment_attention
from .flash_attn import STANDIN_DTYPES

MASK_TYPES = ("padding", "padding_causal", "padding_causal_bottom_right")


class ContractError(RuntimeError):
    """An argument TransformerEngine would reject (or trust) is wrong."""


def _fail(msg: str) -> NoReturn:
    raise ContractError(f"transformer_engine stand-in: {msg}")


@dataclass(frozen=True)
class TEConstruction:
    num_attention_heads: int
    kv_channels: int
    num_gqa_groups: int
    attention_dropout: float
    qkv_format: str
    attn_mask_type: str
    window_size: tuple[int, int] | None
    softmax_scale: float | None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TECall:
    module_id: int
    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    dtype: torch.dtype
    cu_seqlens_q: tuple[int, ...]
    cu_seqlens_kv: tuple[int, ...]
    cu_seqlens_dtype: torch.dtype
    max_seqlen_q: int
    max_seqlen_kv: int
    attn_mask_type: str
    window_size: tuple[int, int]
    softmax_scale: float


def _window(mask_type: str, window_size: object) -> tuple[int, int]:
    causal = "causal" in mask_type
    if window_size is None:
        return (-1, 0) if causal else (-1, -1)
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)):
        _fail(f"window_size={window_size!r} must be None or a pair of ints >= -1")
    if causal and window_size[1] != 0:
        _fail(f"attn_mask_type={mask_type!r} needs window_size[1] == 0, got {tuple(window_size)}")
    return int(window_size[0]), int(window_size[1])


def make_modules(allowed_dtypes: tuple[torch.dtype, ...] = STANDIN_DTYPES) -> tuple[types.ModuleType, types.ModuleType]:
    """Fresh ``(transformer_engine, transformer_engine.pytorch)`` stand-in modules."""
    package = types.ModuleType("transformer_engine")
    package.__version__ = "2.8.0+standin"
    package.__path__ = []  # a package, so ``transformer_engine.pytorch`` is a submodule
    te_pytorch = types.ModuleType("transformer_engine.pytorch")
    package.pytorch = te_pytorch
    constructions: list[TEConstruction] = []
    calls: list[TECall] = []
    te_pytorch.constructions = constructions
    te_pytorch.calls = calls
    te_pytorch.ContractError = ContractError

    class DotProductAttention(torch.nn.Module):
        """Stand-in for TE's ``DotProductAttention`` (``thd`` only); see the module docstring."""

        def __init__(self, num_attention_heads: int, kv_channels: int | tuple[int, int],
                     num_gqa_groups: int | None = None, attention_dropout: float = 0.0, qkv_format: str = "sbhd",
                     attn_mask_type: str = "causal",
                     window_size: tuple[int, int] | None = None, sequence_parallel: bool = False, tp_size: int = 1,
                     get_rng_state_tracker=None, tp_group=None, layer_number: int | None = None,
                     attention_type: str = "self", cp_group=None, cp_global_ranks=None, cp_stream=None,
                     cp_comm_type: str = "p2p", softmax_scale: float | None = None) -> None:
            super().__init__()
            if isinstance(kv_channels, (tuple, list)):
                if kv_channels[0] != kv_channels[1]:
                    raise NotImplementedError("stand-in: different K and V head dims are not implemented")
                kv_channels = kv_channels[0]
            num_gqa_groups = num_attention_heads if num_gqa_groups is None else num_gqa_groups
            if num_gqa_groups < 1 or num_attention_heads % num_gqa_groups:
                _fail(f"num_attention_heads={num_attention_heads} not divisible by num_gqa_groups={num_gqa_groups}")
            if qkv_format != "thd":
                raise NotImplementedError(f"stand-in implements qkv_format='thd' only, got {qkv_format!r}")
            if attn_mask_type not in MASK_TYPES:
                raise NotImplementedError(f"stand-in implements attn_mask_type in {MASK_TYPES}, got {attn_mask_type!r}")
            if attention_dropout:
                raise NotImplementedError("stand-in: attention_dropout is not implemented")
            if cp_group is not None or tp_size != 1 or attention_type != "self":
                raise NotImplementedError("stand-in: context/tensor parallelism and cross attention not implemented")
            self.num_attention_heads = num_attention_heads
            self.kv_channels = kv_channels
            self.num_gqa_groups = num_gqa_groups
            self.attn_mask_type = attn_mask_type
            self.window_size = _window(attn_mask_type, window_size)
            self.softmax_scale = kv_channels ** -0.5 if softmax_scale is None else float(softmax_scale)
            constructions.append(TEConstruction(num_attention_heads, kv_channels, num_gqa_groups,
                                                float(attention_dropout), qkv_format, attn_mask_type,
                                                None if window_size is None else tuple(window_size), softmax_scale,
                                                dict(layer_number=layer_number)))

        def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor, value_layer: torch.Tensor,
                    attention_mask=None, qkv_format: str | None = None, cu_seqlens_q: torch.Tensor | None = None,
                    cu_seqlens_kv: torch.Tensor | None = None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                    max_seqlen_q: int | None = None, max_seqlen_kv: int | None = None,
                    attn_mask_type: str | None = None, window_size: tuple[int, int] | None = None,
                    checkpoint_core_attention: bool = False, core_attention_bias_type: str = "no_bias",
                    core_attention_bias=None, alibi_slopes=None, fast_zero_fill: bool = True,
                    inference_params=None) -> torch.Tensor:
            """``query [t, Hq, D]``, ``key/value [t, Hg, D]`` -> ``[t, Hq * D]``."""
            if qkv_format not in (None, "thd"):
                raise NotImplementedError(f"stand-in implements qkv_format='thd' only, got {qkv_format!r}")
            if (attention_mask is not None or cu_seqlens_q_padded is not None or cu_seqlens_kv_padded is not None
                    or core_attention_bias_type != "no_bias" or core_attention_bias is not None
                    or alibi_slopes is not None or inference_params is not None):
                raise NotImplementedError("stand-in: masks, padded offsets, biases, alibi, inference not implemented")
            mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
            if mask_type not in MASK_TYPES:
                raise NotImplementedError(f"stand-in implements attn_mask_type in {MASK_TYPES}, got {mask_type!r}")
            window = self.window_size if window_size is None else _window(mask_type, window_size)
            q, k, v = query_layer, key_layer, value_layer
            for name, t in (("query_layer", q), ("key_layer", k), ("value_layer", v)):
                if not isinstance(t, torch.Tensor) or t.dim() != 3:
                    _fail(f"{name} must be a 3-D [t, h, d] tensor for thd, got {getattr(t, 'shape', t)}")
                if t.stride(-1) != 1:
                    _fail(f"{name} must have a contiguous last dimension")
            if not q.dtype == k.dtype == v.dtype or q.dtype not in allowed_dtypes:
                _fail(f"q/k/v dtypes {q.dtype}, {k.dtype}, {v.dtype} must agree and be one of {allowed_dtypes}")
            if not q.device == k.device == v.device:
                _fail(f"q/k/v devices differ: {q.device}, {k.device}, {v.device}")
            if q.shape[1] != self.num_attention_heads or k.shape[1] != self.num_gqa_groups or v.shape[1] != k.shape[1]:
                _fail(f"heads {q.shape[1]}/{k.shape[1]}/{v.shape[1]} do not match num_attention_heads="
                      f"{self.num_attention_heads}, num_gqa_groups={self.num_gqa_groups}")
            if not q.shape[2] == k.shape[2] == v.shape[2] == self.kv_channels:
                _fail(f"head dims {q.shape[2]}/{k.shape[2]}/{v.shape[2]} != kv_channels={self.kv_channels}")
            if k.shape[0] != v.shape[0]:
                _fail(f"key has {k.shape[0]} tokens, value {v.shape[0]}")
            cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device, _fail)
            cu_k = check_cu_seqlens("cu_seqlens_kv", cu_seqlens_kv, k.shape[0], q.device, _fail)
            if len(cu_q) != len(cu_k):
                _fail(f"cu_seqlens_q has {len(cu_q)} entries, cu_seqlens_kv {len(cu_k)}")
            for name, value, cu in (("max_seqlen_q", max_seqlen_q, cu_q), ("max_seqlen_kv", max_seqlen_kv, cu_k)):
                exact = max((b - a for a, b in zip(cu, cu[1:])), default=0)
                if not isinstance(value, int) or isinstance(value, bool) or value != exact:
                    _fail(f"{name}={value!r} must be the exact maximum segment length {exact}")
            calls.append(TECall(id(self), tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, cu_q, cu_k,
                                cu_seqlens_q.dtype, max_seqlen_q, max_seqlen_kv, mask_type, window,
                                self.softmax_scale))
            outs = [segment_attention(q[qa:qb], k[ka:kb], v[ka:kb], scale=self.softmax_scale,
                                      causal="causal" in mask_type, window=window,
                                      bottom_right=mask_type.endswith("bottom_right"))[0]
                    for (qa, qb), (ka, kb) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:]))]
            out = torch.cat(outs, dim=0) if outs else q.new_zeros(0, q.shape[1], v.shape[2])
            return out.reshape(q.shape[0], q.shape[1] * v.shape[2])

    te_pytorch.DotProductAttention = DotProductAttention
    return package, te_pytorch
