"""Which of transformers' recurrent token mixers this package serves, and how (the integration layer's table).

transformers 5.25 routes every recurrent token mixer through functions marked replaceable
(``integrations/hub_kernels.py``: ``use_kernel_func_from_hub_with_fallback`` / ``use_kernel_forward_from_hub``,
attached to the mixer class by ``use_kernelized_func``). With the ``kernels`` package installed, each mixer
instance holds a private wrapper per function in ``mixer._kernel_funcs[name]`` and routes the module-level call
to it; ``kernels.kernelize`` replaces such a wrapper's ``forward`` on the instance. :mod:`.mixer_hooks` does the
same for the functions listed here (no module global of transformers is touched). The private names involved are in
:mod:`.compat`; the descriptions (:mod:`.recurrent.specs`) and everything that runs them (:mod:`.recurrent`) know
neither transformers nor ``kernels``. A new mixer family is one state algebra (:mod:`.recurrent.algebra`) and one
row here.

Each function is one of three kinds:

- :data:`SCANS`: sequence mixers the package runs per document fragment (convolution and scans).
- :data:`COMPOSITES`: functions that only dispatch to the scans above (their torch path), or decode-only steps
  (one token with a cache): left as they are.
- :data:`FUSED`: fused GPU paths that would mix documents inside one kernel call; skipped with packed rows (the
  layers then take their unfused path).

Modules that mix tokens with a plain ``nn.Conv1d`` and no replaceable function are listed in :data:`WINDOWED` by
class name and served whole, once per fragment (or, for a plain ``nn.Conv1d`` child of such a module, the child).
Mixers whose scan is an instance method of the module rather than a replaceable function are listed in
:data:`METHODS` by the module's class name; the method is served like a scan (an instance attribute shadows it).
Mixers whose linear recurrence runs inside their own ``forward`` are listed in :data:`STATEFUL` and served whole;
modules that are one scan taking their initial state as arguments (xLSTM's mLSTM backend), in :data:`SCAN_MODULES`.

A transformers upgrade that renames one of them fails ``tests/recurrent/test_packed_cp1.py`` (the names and
parameters below are checked against the installed model files), not a user.
"""

from __future__ import annotations

from typing import Any

import torch

from .compat import RGLRU_SCAN_METHOD
from .recurrent.algebra import MlstmAlgebra
from .recurrent.kinds import MixerKind
from .recurrent.specs import ScanFunction, ScanModule, StatefulModule, WindowedModule

__all__ = ["COMPOSITES", "FUSED", "METHODS", "POSITION_RESETS", "SCANS", "SCAN_MODULES", "STATEFUL", "WINDOWED",
           "conv_window"]


_DELTA_PARAMS = ("query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state",
                 "use_qk_l2norm_in_kernel")

#: The sequence mixers served per document fragment, by kernel layer name.
SCANS: dict[str, ScanFunction] = {f.name: f for f in (
    ScanFunction("causal_conv1d_fn", ("hidden_states", "weight", "bias", "activation"), {"hidden_states": -1}, -1,
                 None, None, False, MixerKind.CONV),
    ScanFunction("chunk_gated_delta_rule", _DELTA_PARAMS, {n: 1 for n in ("query", "key", "value", "g", "beta")}, 1,
                 "initial_state", "output_final_state", True, MixerKind.DELTA),
    ScanFunction("chunk_kda", _DELTA_PARAMS, {n: 1 for n in ("query", "key", "value", "g", "beta")}, 1,
                 "initial_state", "output_final_state", True, MixerKind.KDA),
    ScanFunction("mamba_chunk_scan_combined",
                 ("hidden_states", "dt", "A", "B", "C", "chunk_size", "D", "dt_bias", "initial_states", "dt_softplus",
                  "dt_limit", "return_final_states"),
                 {"hidden_states": 1, "dt": 1, "B": 1, "C": 1, "z": 1, "seq_idx": 1}, 1,
                 "initial_states", "return_final_states", False, MixerKind.SSD),
    ScanFunction("selective_scan_fn",
                 ("hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus", "return_last_state"),
                 {"hidden_states": -1, "dt": -1, "B": -1, "C": -1, "z": -1}, -1,
                 None, "return_last_state", False, MixerKind.SELECTIVE),
)}

#: Instance methods served per document fragment like :data:`SCANS`, by the class name of the module holding them
#: (``name`` is the method's). RecurrentGemma's RG-LRU: ``_rnn_scan(hidden_states [B, T, W], recurrent_gate
#: [B, T, W], reset [B, T, 1], recurrent_states [B, W] | None)`` runs ``h_t = a_t * (not reset_t) * h_{t-1} + x_t``
#: in fp32 and returns ``(out [B, T, W], h_T [B, W])``.
METHODS: dict[str, ScanFunction] = {
    "RecurrentGemmaRglru": ScanFunction(RGLRU_SCAN_METHOD, ("hidden_states", "recurrent_gate", "reset",
                                                            "recurrent_states",
                                                      "acc_dtype"),
                                        {n: 1 for n in ("hidden_states", "recurrent_gate", "reset")}, 1,
                                        "recurrent_states", None, True, MixerKind.DIAG),
}

#: Classes of :data:`METHODS` whose module derives more than the scan's resets from ``position_ids`` (RG-LRU: the
#: input normalisation ``sqrt(1 - a^2)`` is skipped where they are 0): a packed batch must carry per-document
#: ``position_ids`` (refused otherwise, as for absolute position embeddings).
POSITION_RESETS: frozenset[str] = frozenset({"RecurrentGemmaRglru"})

#: Functions that dispatch to :data:`SCANS` (torch path) or only step one token with a cache.
COMPOSITES: frozenset[str] = frozenset({
    "causal_conv1d_forward", "causal_conv1d_update", "mamba2_scan_forward", "mamba_scan_forward",
    "selective_state_update", "fused_recurrent_gated_delta_rule", "fused_recurrent_kda", "rotary_pos_emb"})

#: Fused GPU paths (mamba_ssm) whose one kernel call covers the whole row: skipped with packed rows.
FUSED: frozenset[str] = frozenset({"mamba_split_conv1d_scan_combined", "mamba_inner_fn"})


#: Modules served whole per fragment, by class name: zaya's compressed convolutional attention projection (two
#: ``nn.Conv1d`` over ``(cca_time0 - 1) + (cca_time1 - 1)`` earlier q/k inputs, and a value half from the previous
#: token); RecurrentGemma's depthwise ``conv_1d`` (channels first, padded by ``K - 1`` on both sides, the block
#: keeping the first ``T`` outputs).
WINDOWED: dict[str, WindowedModule] = {m.name: m for m in (
    WindowedModule("ZayaCCAProjection", ("hidden_states", "cache", "conv_mask"), "hidden_states", "conv_mask",
                   "cache", "conv_kernel_size"),
    WindowedModule("RecurrentGemmaRecurrentBlock", ("input",), "input", None, None, None, child="conv_1d",
                   time_dim=-1, owner_reads="self.conv_1d(x_branch)[..., :seq_len]"),
)}


def conv_window(conv: torch.nn.Module) -> int | None:
    """Earlier inputs each of the first ``T`` outputs of a plain ``nn.Conv1d`` reads (``(K - 1) * dilation``), or
    ``None`` when the convolution is not causal that way (stride > 1, other padding): then it is not served."""
    if not isinstance(conv, torch.nn.Conv1d):
        return None
    window = (conv.kernel_size[0] - 1) * conv.dilation[0]
    if conv.stride != (1,) or conv.padding != (window,) or conv.padding_mode != "zeros" or window < 1:
        return None
    return window


def _mlstm_algebra(named: dict[str, Any]) -> MlstmAlgebra:
    key, value = named["key"], named["value"]  # [B, H, T, Dqk], [B, H, T, Dv]
    return MlstmAlgebra(key.shape[1], key.shape[3], value.shape[3])


def _mlstm_transition(named: dict[str, Any], f: Any) -> tuple[torch.Tensor]:
    """The fragment's total log forget gate ``F [1, H, 1]`` (the state is scaled by ``exp(F)`` over it)."""
    fgate = named["fgate"][f.row:f.row + 1].narrow(2, f.start, f.length).float()  # [1, H, T]
    return (torch.nn.functional.logsigmoid(fgate).sum(-1, keepdim=True),)


def _mlstm_returns_states(module: Any, named: dict[str, Any]) -> bool:
    """xLSTM's backend returns its last states in inference mode always, in training modes when asked (its config's
    default when the call does not say)."""
    mode = named.get("mode") or module.config.mode
    want = named.get("return_last_states")
    return "inference" in mode or bool(module.config.return_last_states if want is None else want)


#: Scan modules served per fragment, by class name: xLSTM's mLSTM backend (state ``C [B, H, Dqk, Dv]``, normalizer
#: ``n [B, H, Dqk]`` and stabilizer ``m [B, H, 1]``).
SCAN_MODULES: dict[str, ScanModule] = {m.name: m for m in (
    ScanModule("xLSTMBackend", ("query", "key", "value", "igate", "fgate", "c_initial", "n_initial", "m_initial",
                                "return_last_states", "mode"),
               {"query": 2, "key": 2, "value": 2, "igate": 2, "fgate": 2}, 2,
               ("c_initial", "n_initial", "m_initial"), "return_last_states", _mlstm_algebra, _mlstm_transition,
               _mlstm_returns_states),
)}


#: Modules served whole per fragment with their state passed between fragments, by class name: MiniMax's lightning
#: attention (``S_t = exp(-slope) S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t`` per head, then a per-token norm and gate;
#: its cache is read with ``get_linear_cache(layer_idx)`` and written with ``set_linear_cache``).
STATEFUL: dict[str, StatefulModule] = {m.name: m for m in (
    StatefulModule("MiniMaxLightningAttention", ("hidden_states", "position_embeddings", "attention_mask", "cache"),
                   "hidden_states", ("position_embeddings", "attention_mask"), "cache", "get_linear_cache",
                   "set_linear_cache", "layer_idx", "num_attention_heads", "head_dim", "slope_rate"),
)}
