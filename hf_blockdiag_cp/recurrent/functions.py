"""Which of transformers' replaceable recurrent functions this package serves, and how.

transformers 5.25 routes every recurrent token mixer through functions marked replaceable
(``integrations/hub_kernels.py``: ``use_kernel_func_from_hub_with_fallback`` / ``use_kernel_forward_from_hub``,
attached to the mixer class by ``use_kernelized_func``). With the ``kernels`` package installed, each mixer
instance holds a private wrapper per function in ``mixer._kernel_funcs[name]`` and routes the module-level call
to it; ``kernels.kernelize`` replaces such a wrapper's ``forward`` on the instance. :mod:`.install` does the same
for the functions listed here (no module global of transformers is touched).

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

A transformers upgrade that renames one of them fails ``tests/recurrent/test_functions.py`` (the names and
parameters below are checked against the installed model files), not a user.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["COMPOSITES", "FUSED", "METHODS", "POSITION_RESETS", "SCANS", "SCAN_MODULES", "STATEFUL", "WINDOWED",
           "ScanFunction", "ScanModule", "StatefulModule", "WindowedModule", "conv_window", "mixer_functions"]


@dataclass(frozen=True)
class ScanFunction:
    """How one replaceable sequence mixer is called (names as in transformers 5.25).

    Attributes:
        name: the kernel layer name (the key in ``mixer._kernel_funcs``).
        params: its leading parameters in order (to bind positional arguments).
        time_args: parameters with a time axis, and that axis (negative: counted from the end).
        out_dim: the time axis of the output.
        state_in: the initial-state parameter (``None``: the function takes none).
        state_flag: the parameter asking for the final state.
        returns_tuple: the output is always ``(out, state)``; otherwise a tuple only when ``state_flag`` is true.
        kind: ``"conv"``, ``"ssd"``, ``"delta"``, ``"kda"``, ``"selective"`` or ``"diag"`` (a diagonal linear
            recurrence ``h_t = a_t * h_{t-1} + x_t``, state ``[B, W]`` fp32).
    """

    name: str
    params: tuple[str, ...]
    time_args: dict[str, int]
    out_dim: int
    state_in: str | None
    state_flag: str | None
    returns_tuple: bool
    kind: str


_DELTA_PARAMS = ("query", "key", "value", "g", "beta", "chunk_size", "initial_state", "output_final_state",
                 "use_qk_l2norm_in_kernel")

#: The sequence mixers served per document fragment, by kernel layer name.
SCANS: dict[str, ScanFunction] = {f.name: f for f in (
    ScanFunction("causal_conv1d_fn", ("hidden_states", "weight", "bias", "activation"), {"hidden_states": -1}, -1,
                 None, None, False, "conv"),
    ScanFunction("chunk_gated_delta_rule", _DELTA_PARAMS, {n: 1 for n in ("query", "key", "value", "g", "beta")}, 1,
                 "initial_state", "output_final_state", True, "delta"),
    ScanFunction("chunk_kda", _DELTA_PARAMS, {n: 1 for n in ("query", "key", "value", "g", "beta")}, 1,
                 "initial_state", "output_final_state", True, "kda"),
    ScanFunction("mamba_chunk_scan_combined",
                 ("hidden_states", "dt", "A", "B", "C", "chunk_size", "D", "dt_bias", "initial_states", "dt_softplus",
                  "dt_limit", "return_final_states"),
                 {"hidden_states": 1, "dt": 1, "B": 1, "C": 1, "z": 1, "seq_idx": 1}, 1,
                 "initial_states", "return_final_states", False, "ssd"),
    ScanFunction("selective_scan_fn",
                 ("hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus", "return_last_state"),
                 {"hidden_states": -1, "dt": -1, "B": -1, "C": -1, "z": -1}, -1,
                 None, "return_last_state", False, "selective"),
)}

#: Instance methods served per document fragment like :data:`SCANS`, by the class name of the module holding them
#: (``name`` is the method's). RecurrentGemma's RG-LRU: ``_rnn_scan(hidden_states [B, T, W], recurrent_gate
#: [B, T, W], reset [B, T, 1], recurrent_states [B, W] | None)`` runs ``h_t = a_t * (not reset_t) * h_{t-1} + x_t``
#: in fp32 and returns ``(out [B, T, W], h_T [B, W])``.
METHODS: dict[str, ScanFunction] = {
    "RecurrentGemmaRglru": ScanFunction("_rnn_scan", ("hidden_states", "recurrent_gate", "reset", "recurrent_states",
                                                      "acc_dtype"),
                                        {n: 1 for n in ("hidden_states", "recurrent_gate", "reset")}, 1,
                                        "recurrent_states", None, True, "diag"),
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


@dataclass(frozen=True)
class WindowedModule:
    """A module that mixes tokens with a plain ``nn.Conv1d`` (no replaceable function): its output at ``t`` depends
    on its inputs at ``t - window .. t`` only, so it is served as a whole, once per fragment (the instance
    ``forward`` is replaced, as for the wrappers). A fragment that continues a document gets the document's last
    ``window`` earlier inputs (fewer at its start) prepended, from the CP ranks that hold them; their outputs are
    dropped.

    Attributes:
        name: the module's class name (transformers 5.25); with ``child``, the class of the module holding it.
        params: its ``forward``'s parameters in order (to bind positional arguments).
        sequence: the input ``[B, T, C]`` (time axis 1) or ``[B, C, T]`` (``time_dim=-1``); every output has its
            time axis at ``time_dim``, and its first ``T`` steps are the outputs of the ``T`` inputs.
        mask: an optional padding mask ``[B, T]`` sliced with the sequence.
        cache: the cache parameter (must be ``None`` with packed rows), if any.
        window_attr: the module attribute holding how many earlier inputs an output reads (at least 1); ``None``
            for a plain ``nn.Conv1d`` (:func:`conv_window`).
        child: the served module is this plain ``nn.Conv1d`` attribute of the ``name`` module, not that module.
        time_dim: the time axis of the sequence and the outputs (1 or -1).
        owner_reads: for a ``child``: the expression in the owner's ``forward`` that reads the child's output. A
            served child returns the ``T`` outputs of its ``T`` inputs only (a padded ``nn.Conv1d`` returns more),
            which is all this expression reads; checked against the owner's source by the tests.
    """

    name: str
    params: tuple[str, ...]
    sequence: str
    mask: str | None
    cache: str | None
    window_attr: str | None
    child: str | None = None
    time_dim: int = 1
    owner_reads: str | None = None


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


@dataclass(frozen=True)
class ScanModule:
    """A module that is one recurrent scan taking its initial state as arguments (xLSTM's mLSTM backend): served
    once per fragment by an instance ``forward``, a continuing fragment from its composed incoming state
    (:mod:`.scan_modules`).

    Attributes:
        name: the module's class name (transformers 5.25).
        params: its ``forward``'s parameters in order (to bind positional arguments).
        time_args: parameters with a time axis, and that axis; the output ``h`` has its time axis at ``out_dim``.
        out_dim: the output's time axis.
        state_in: the initial-state parameters, in the order the module returns its last states.
        state_flag: the parameter asking for the last states (the module returns ``(h, states)`` then).
        kind: ``"mlstm"``.
    """

    name: str
    params: tuple[str, ...]
    time_args: dict[str, int]
    out_dim: int
    state_in: tuple[str, ...]
    state_flag: str
    kind: str


#: Scan modules served per fragment, by class name: xLSTM's mLSTM backend (state ``C [B, H, Dqk, Dv]``, normalizer
#: ``n [B, H, Dqk]`` and stabilizer ``m [B, H, 1]``).
SCAN_MODULES: dict[str, ScanModule] = {m.name: m for m in (
    ScanModule("xLSTMBackend", ("query", "key", "value", "igate", "fgate", "c_initial", "n_initial", "m_initial",
                                "return_last_states", "mode"),
               {"query": 2, "key": 2, "value": 2, "igate": 2, "fgate": 2}, 2,
               ("c_initial", "n_initial", "m_initial"), "return_last_states", "mlstm"),
)}


def mixer_functions(module: object) -> dict[str, object] | None:
    """The private per-instance wrappers of a module decorated with ``use_kernelized_func`` (``None``: none)."""
    funcs = getattr(module, "__dict__", {}).get("_kernel_funcs")
    return funcs if isinstance(funcs, dict) and funcs else None


@dataclass(frozen=True)
class StatefulModule:
    """A token mixer whose linear recurrence runs inside its own ``forward`` (no replaceable function or method), all
    else in it per token. Served whole, once per fragment (the instance ``forward`` is replaced): without a cache the
    forward starts from a zero state and returns ``(out, end state)``; a fragment that continues a document runs with
    a stand-in cache that hands it the composed incoming state (the forward's own cached path, token by token).

    Attributes:
        name: the module's class name (transformers 5.25).
        params: its ``forward``'s parameters in order (to bind positional arguments).
        sequence: the input ``[B, T, C]`` (time axis 1); the output ``[B, T, C]`` too.
        time_args: other parameters with a time axis at 1, tensors or tuples of tensors (rotary ``(cos, sin)``,
            a padding mask), sliced with the sequence.
        cache: the cache parameter; the stand-in is passed there. With packed rows a given cache must hold no state
            for the layer yet (a prefill, e.g. ``generate()`` on left-padded rows, CP = 1): it then gets the end
            state of each row's last fragment, as the stock forward leaves it.
        cache_get / cache_set: the cache's methods the forward reads and writes its state with (``(layer_idx)``,
            ``(layer_idx, state)``).
        layer_attr: the module attribute holding its layer index.
        heads_attr / dim_attr: module attributes giving the state ``[H, D, D]``.
        rate_attr: module buffer ``[H, ...]`` of the per-token decay rate: the state decays by ``exp(-rate)`` a token.
    """

    name: str
    params: tuple[str, ...]
    sequence: str
    time_args: tuple[str, ...]
    cache: str
    cache_get: str
    cache_set: str
    layer_attr: str
    heads_attr: str
    dim_attr: str
    rate_attr: str


#: Modules served whole per fragment with their state passed between fragments, by class name: MiniMax's lightning
#: attention (``S_t = exp(-slope) S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t`` per head, then a per-token norm and gate;
#: its cache is read with ``get_linear_cache(layer_idx)`` and written with ``set_linear_cache``).
STATEFUL: dict[str, StatefulModule] = {m.name: m for m in (
    StatefulModule("MiniMaxLightningAttention", ("hidden_states", "position_embeddings", "attention_mask", "cache"),
                   "hidden_states", ("position_embeddings", "attention_mask"), "cache", "get_linear_cache",
                   "set_linear_cache", "layer_idx", "num_attention_heads", "head_dim", "slope_rate"),
)}
