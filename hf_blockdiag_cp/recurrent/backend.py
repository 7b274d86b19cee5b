"""Which kernel runs a recurrent call: the model's own function per fragment, or one of the package's ops.

``BlockDiagCPConfig.recurrent_backend`` asks (:data:`~hf_blockdiag_cp.config.RECURRENT_BACKENDS`); this module
resolves the request once per forward (:func:`forward_backend`, on the host: the request and which kernel libraries
this process can import) and per call (:func:`call_backend`, a pure function of the forward's choice, the mixer
kind and the call's arguments, so every CP rank resolves alike from the same agreed inputs):

- ``"model"``: transformers' function once per document fragment (:class:`~.scan_runner.ScanRunner`).
- ``"torch"``: :data:`~.ops.TORCH_OPS`, one varlen call per served call (the same runner).
- ``"fla"`` / ``"mamba_ssm"``: :data:`~.ops.adapters.LIBRARY_OPS` for the kinds the library covers (``fla``: gated
  delta rule, KDA; ``mamba_ssm``: SSD, Mamba1; both: the short convolution through causal-conv1d), where the
  adapter says it can run the call; the torch op otherwise.
- ``"auto"``: on CUDA the libraries where installed, else the torch ops; on CPU per kind, what measured exact and
  faster on a packed 16K row (``benchmarks/bench_recurrent_layers.py``, :data:`AUTO_ON_CPU`).

A call whose arguments an op cannot express (an activation, a keyword the op does not know) takes ``"model"``
(:func:`op_refusal` names why), never a silently different computation. The forward agreement
(:mod:`hf_blockdiag_cp.model.forward_agreement`) compares :func:`agreement_code` across CP ranks before any
collective, so ranks asking for different backends (or seeing different libraries) raise the package's
:class:`~hf_blockdiag_cp.errors.AgreementError` together.
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any

import torch

from ..config import RECURRENT_BACKENDS
from .kinds import MixerKind

K = MixerKind

__all__ = ["AUTO_ON_CPU", "LIBRARY_KINDS", "SEMANTIC_KEYWORDS", "agreement_code", "call_backend", "describe_code",
           "forward_backend", "op_refusal"]

#: ``"auto"`` on CPU, per mixer kind (:attr:`~.functions.ScanFunction.kind`), measured with
#: ``benchmarks/bench_recurrent_layers.py`` (docs/benchmarks.md, one layer on a packed 16K row): the chunked ops are
#: 2.5-4x faster than the model's function per fragment for the gated delta rule, KDA and Mamba1; for SSD and the
#: short convolution the model's function per fragment was as fast or faster (both exact), so it stays.
AUTO_ON_CPU: dict[MixerKind, str] = {K.DELTA: "torch", K.KDA: "torch", K.SELECTIVE: "torch", K.SSD: "model",
                                      K.CONV: "model"}
#: The kinds each library adapter covers (the rest run the torch op under that request).
LIBRARY_KINDS: dict[str, frozenset[MixerKind]] = {"fla": frozenset({K.DELTA, K.KDA, K.CONV}),
                                                  "mamba_ssm": frozenset({K.SSD, K.SELECTIVE, K.CONV})}
#: The library module behind each (library, kind): what must import for the adapter to run.
_MODULES: dict[tuple[str, MixerKind], str] = {
    ("fla", K.DELTA): "fla", ("fla", K.KDA): "fla", ("fla", K.CONV): "causal_conv1d",
    ("mamba_ssm", K.SSD): "mamba_ssm", ("mamba_ssm", K.SELECTIVE): "mamba_ssm", ("mamba_ssm", K.CONV): "causal_conv1d",
}
_LIBRARIES: tuple[str, ...] = ("fla", "mamba_ssm", "causal_conv1d")


@functools.lru_cache(maxsize=None)  # this module's one cache: whether a library is importable does not change
def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _library_mask(device: torch.device) -> int:
    """Bit ``i``: library ``_LIBRARIES[i]`` importable here and the device is CUDA (0 on CPU)."""
    if device.type != "cuda":
        return 0
    return sum(1 << i for i, name in enumerate(_LIBRARIES) if _importable(name))


def forward_backend(request: str, device: torch.device) -> tuple[str, int]:
    """The forward's backend request and the library mask it resolves against (host, once per forward)."""
    if request not in RECURRENT_BACKENDS:
        raise ValueError(f"recurrent_backend={request!r} is not one of {', '.join(RECURRENT_BACKENDS)}")
    return request, _library_mask(device)


def agreement_code(request: str, device: torch.device) -> int:
    """What the forward agreement compares: the request and the libraries this process can use."""
    _, mask = forward_backend(request, device)
    return RECURRENT_BACKENDS.index(request) + len(RECURRENT_BACKENDS) * mask


def describe_code(code: int) -> str:
    """An :func:`agreement_code` as the agreement error quotes it."""
    n = len(RECURRENT_BACKENDS)
    request, mask = RECURRENT_BACKENDS[code % n] if 0 <= code % n < n else "?", code // n
    libs = [name for i, name in enumerate(_LIBRARIES) if mask >> i & 1]
    return f"{request!r}" + (f" with {'+'.join(libs)}" if libs else "")


#: Keywords that the kernel libraries behind each kind read (flash-linear-attention, mamba_ssm, causal-conv1d) and
#: the ops do not: a call carrying one (not ``None`` / ``False``) takes ``"model"``. Every other keyword a model hands
#: through (``TransformersKwargs``, a batch's extra keys such as ``shift_labels``, rotary embeddings) lands in the
#: ``**kwargs`` of transformers' torch functions, which ignore it; so does the op.
SEMANTIC_KEYWORDS: dict[MixerKind, frozenset[str]] = {
    K.DELTA: frozenset({"scale", "head_first", "use_gate_in_kernel", "A_log", "dt_bias", "lower_bound", "safe_gate",
                        "use_beta_sigmoid_in_kernel", "transpose_state_layout"}),
    K.SSD: frozenset({"z", "return_varlen_states", "D_has_hdim"}),
    K.SELECTIVE: frozenset(),
    K.CONV: frozenset({"initial_states", "return_final_states", "final_states_out"}),
}
SEMANTIC_KEYWORDS[K.KDA] = SEMANTIC_KEYWORDS[K.DELTA]


def op_refusal(kind: MixerKind, named: dict[str, Any], known: frozenset[str]) -> str | None:
    """Why the package's op cannot compute this call exactly as the model's function does (``None``: it can).

    Args:
        kind: the mixer kind; named: the call's arguments (packing keywords already removed);
        known: every argument name the op path maps (of the rest, those in :data:`SEMANTIC_KEYWORDS` must be absent,
            ``None`` or ``False``).
    """
    kind = MixerKind(kind)
    semantic = SEMANTIC_KEYWORDS.get(kind, frozenset())
    extra = sorted(k for k, v in named.items() if k not in known and k in semantic and v is not None and v is not False)
    if extra:
        return f"arguments {extra} that the package's op does not take"
    if kind is K.CONV:
        weight = named["weight"]
        if weight.dim() != 2:
            return f"a weight of shape {tuple(weight.shape)} (the op takes [C, K])"
        if named.get("activation") not in (None, "silu", "swish"):
            return f"activation={named.get('activation')!r} (the op has None, 'silu', 'swish')"
    elif kind is K.SSD:
        if named.get("z") is not None:
            return "a z gate (transformers' torch scan ignores it, the op would not)"
        d = named.get("D")
        heads, head_dim = named["hidden_states"].shape[2:]
        if d is not None and tuple(d.shape) not in ((heads,), (heads, head_dim)):
            return f"D of shape {tuple(d.shape)}"
        if named["A"].dim() != 1:
            return f"A of shape {tuple(named['A'].shape)} (the op takes [H])"
    elif kind is K.SELECTIVE:
        if named["A"].dim() != 2:
            return f"A of shape {tuple(named['A'].shape)} (the op takes [D, N])"
    elif kind in (K.DELTA, K.KDA):
        if named.get("chunk_size") is not None and not isinstance(named.get("chunk_size"), int):
            return f"chunk_size={named.get('chunk_size')!r}"
    else:
        return f"a mixer kind {str(kind)!r} the ops do not cover"
    return None


def call_backend(choice: tuple[str, int], kind: MixerKind, device: torch.device) -> str:
    """The backend of one call before argument checks: ``"model"``, ``"torch"``, ``"fla"`` or ``"mamba_ssm"``.

    ``choice``: :func:`forward_backend`'s result (agreed across CP ranks). A library request for a kind the library
    does not cover, or on a process without it, runs the torch op (the adapters take the same arguments).
    """
    kind = MixerKind(kind)
    request, mask = choice
    if request == "model":
        return "model"
    libraries = [name for name in ("fla", "mamba_ssm") if request in (name, "auto")]
    if device.type == "cuda":
        for name in libraries:
            module = _MODULES.get((name, kind))
            if module is not None and mask >> _LIBRARIES.index(module) & 1:
                return name
    if request == "auto" and device.type != "cuda":
        return AUTO_ON_CPU.get(kind, "model")
    return "torch"
