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
class name and served whole, once per fragment.

A transformers upgrade that renames one of them fails ``tests/recurrent/test_functions.py`` (the names and
parameters below are checked against the installed model files), not a user.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COMPOSITES", "FUSED", "SCANS", "WINDOWED", "ScanFunction", "WindowedModule", "mixer_functions"]


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
        kind: ``"conv"``, ``"ssd"``, ``"delta"``, ``"kda"`` or ``"selective"``.
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
        name: the module's class name (transformers 5.25).
        params: its ``forward``'s parameters in order (to bind positional arguments).
        sequence: the input ``[B, T, C]`` (time axis 1); every output has its time axis at 1.
        mask: an optional padding mask ``[B, T]`` sliced with the sequence.
        cache: the cache parameter (must be ``None`` with packed rows).
        window_attr: the module attribute holding how many earlier inputs an output reads (at least 1).
    """

    name: str
    params: tuple[str, ...]
    sequence: str
    mask: str | None
    cache: str
    window_attr: str


#: Modules served whole per fragment, by class name: zaya's compressed convolutional attention projection (two
#: ``nn.Conv1d`` over ``(cca_time0 - 1) + (cca_time1 - 1)`` earlier q/k inputs, and a value half from the previous
#: token).
WINDOWED: dict[str, WindowedModule] = {m.name: m for m in (
    WindowedModule("ZayaCCAProjection", ("hidden_states", "cache", "conv_mask"), "hidden_states", "conv_mask",
                   "cache", "conv_kernel_size"),
)}


def mixer_functions(module: object) -> dict[str, object] | None:
    """The private per-instance wrappers of a module decorated with ``use_kernelized_func`` (``None``: none)."""
    funcs = getattr(module, "__dict__", {}).get("_kernel_funcs")
    return funcs if isinstance(funcs, dict) and funcs else None
