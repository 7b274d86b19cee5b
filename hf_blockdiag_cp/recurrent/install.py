"""Serving transformers' recurrent mixers per document: what :func:`~hf_blockdiag_cp.model.prepare_model` installs.

For every mixer of a model that carries private kernel wrappers (``use_kernelized_func``, see :mod:`.functions`),
the wrapper of each served scan gets an instance ``forward`` (as ``kernels.kernelize`` does) that

- passes the call through unchanged when the forward has one document per row (generation, unpacked batches);
- otherwise runs the model's own function once per fragment (:mod:`.runs`) with a zero initial state, so every
  scan and causal convolution restarts at each document start (CP = 1), or hands the fragment summaries
  between CP ranks (:mod:`.state_passing`, CP > 1).

The fragments come from the forward's preparation (the model pre-hook stores them in the probe), so a decoder
layer that drops the model's keyword arguments (jamba, mamba, falcon_mamba) is served as well as one that
passes them. Fused GPU paths (:data:`~.functions.FUSED`) are skipped with packed rows (they return ``None``,
as their torch stand-ins do, and the layer runs its unfused, served path). A windowed module
(:data:`~.functions.WINDOWED`) gets an instance ``forward`` that runs it once per fragment
(:func:`~.state_passing.run_window`).
"""

from __future__ import annotations

import inspect
from types import MethodType
from typing import Any, Callable

import torch

from ..errors import UnsupportedModel
from .backend import call_backend, op_refusal
from .fragment_call import bind, call_fragment, time_axis
from .functions import COMPOSITES, FUSED, SCANS, WINDOWED, ScanFunction, mixer_functions
from .op_call import known_arguments, run_ops
from .runs import LocalRuns
from .state_passing import run_cp, run_window

__all__ = ["INSTALLED_ATTR", "install_recurrent", "is_served", "uninstall_recurrent", "unserved_functions"]

#: Attribute on a served private wrapper: the original bound ``forward`` (the model's own function).
INSTALLED_ATTR = "_blockdiag_cp_original"
#: Keywords the model's own functions must not get with packed rows (their torch paths raise on them).
_PACKING_KEYWORDS = ("cu_seqlens", "seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                     "cp_context", "position_ids")


def unserved_functions(module: torch.nn.Module) -> list[str]:
    """Names of ``module``'s replaceable functions this package does not know (empty: fully served)."""
    funcs = mixer_functions(module) or {}
    return sorted(name for name in funcs if name not in SCANS and name not in COMPOSITES and name not in FUSED)


def is_served(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a recurrent mixer whose every scan is served per fragment (or a windowed module)."""
    if type(module).__name__ in WINDOWED:
        return True
    funcs = mixer_functions(module)
    return funcs is not None and any(name in SCANS for name in funcs) and not unserved_functions(module)


def install_recurrent(model: torch.nn.Module, probe: Any) -> int:
    """Install the per-fragment forwards on every served mixer of ``model``; returns how many mixers.

    Args:
        probe: the model's :class:`~hf_blockdiag_cp.model.prepare.ForwardProbe`: its ``runs`` are the fragments of
            the forward in progress (set by the pre-hook); every served call with packed rows counts as a call of
            the package's token mixing (``attention_calls``), so that a packed forward of a model without attention
            layers is not refused.

    Idempotent (a wrapper keeps its first original). Everything lives in the wrappers' ``__dict__`` (no closure), so a
    deep copy of the model (e.g. a reference copy) reads its own probe.
    """
    count = 0
    for module in model.modules():
        if not is_served(module):
            continue
        count += 1
        if type(module).__name__ in WINDOWED:
            module.__dict__[_PROBE_KEY] = probe
            if INSTALLED_ATTR not in module.__dict__:
                module.__dict__[INSTALLED_ATTR] = module.forward
                module.forward = MethodType(_window_forward, module)
            continue
        for name, wrapper in mixer_functions(module).items():
            if name not in SCANS and name not in FUSED:
                continue
            wrapper.__dict__[_PROBE_KEY] = probe
            if INSTALLED_ATTR in wrapper.__dict__:
                continue
            wrapper.__dict__[INSTALLED_ATTR] = wrapper.forward
            wrapper.__dict__[_NAME_KEY] = name
            wrapper.forward = MethodType(_scan_forward if name in SCANS else _fused_forward, wrapper)
    return count


_PROBE_KEY = "_blockdiag_cp_probe"
_NAME_KEY = "_blockdiag_cp_name"


def _held_runs(probe: Any) -> LocalRuns | None:
    """The fragments of the forward in progress (or being recomputed in backward); ``None`` for one document per
    row and for a later direct call of a submodule, whose model pre-hook did not run."""
    return probe.runs if probe.holds_step() else None


def _fused_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    if _held_runs(self.__dict__[_PROBE_KEY]) is not None:
        # The fused kernel runs the whole row in one call (state across documents). ``None`` is what its torch
        # stand-in returns: every layer calling it then takes its unfused path, whose scans are served.
        return None
    return self.__dict__[INSTALLED_ATTR](*args, **kwargs)


def _scan_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    probe = self.__dict__[_PROBE_KEY]
    original = self.__dict__[INSTALLED_ATTR]
    runs = _held_runs(probe)
    if runs is None:
        return original(*args, **kwargs)
    probe.attention_calls += 1
    return run_fragments(SCANS[self.__dict__[_NAME_KEY]], original, runs, args, kwargs)


def _window_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    probe = self.__dict__[_PROBE_KEY]
    original = self.__dict__[INSTALLED_ATTR]
    runs = _held_runs(probe)
    if runs is None:
        return original(*args, **kwargs)
    spec = WINDOWED[type(self).__name__]
    named = bind(spec, args, kwargs)
    for key in _PACKING_KEYWORDS:  # the fragments replace them (a module reading seq_idx would reset twice)
        named.pop(key, None)
    if named.get(spec.cache) is not None:
        raise UnsupportedModel(f"{spec.name} got a cache with packed rows; blockdiag_cp trains packed rows without a "
                               "cache (pass use_cache=False)")
    window = max(1, int(getattr(self, spec.window_attr)))
    lead = named[spec.sequence]
    if lead.shape[0] != runs.batch_size or lead.shape[1] != runs.local_len:
        raise ValueError(f"{spec.name} got rows [B={lead.shape[0]}, T={lead.shape[1]}] but this forward's packed "
                         f"batch has [B={runs.batch_size}, L={runs.local_len}]")
    return run_window(spec, original, runs, named, window)


def run_fragments(spec: ScanFunction, original: Callable, runs: LocalRuns, args: tuple,
                  kwargs: dict[str, Any]) -> Any:
    """Run the model's own function once per fragment, each from a zero state (CP = 1), and reassemble the rows.

    Under CP the fragments that continue a document get their incoming state from :mod:`.state_passing`. When the
    forward's recurrent backend (:mod:`.backend`) picks an op and the op can express the call, the op runs instead,
    once over all fragments (:mod:`.op_call`).
    """
    named = bind(spec, args, kwargs)
    for key in _PACKING_KEYWORDS:
        named.pop(key, None)
    if spec.state_in is not None and named.get(spec.state_in) is not None:
        raise UnsupportedModel(f"{spec.name} got an initial state (a cache) with packed rows; blockdiag_cp "
                                  "trains packed rows without a cache (pass use_cache=False)")
    lead = named[next(iter(spec.time_args))]
    length = lead.shape[time_axis(lead, spec.time_args[next(iter(spec.time_args))])]
    if lead.shape[0] != runs.batch_size or length != runs.local_len:
        raise ValueError(f"{spec.name} got rows [B={lead.shape[0]}, T={length}] but this forward's packed batch has "
                         f"[B={runs.batch_size}, L={runs.local_len}]")
    backend = call_backend(runs.backend, spec.kind, lead.device)
    if backend != "model" and op_refusal(spec.kind, named, known_arguments(spec)) is None:
        return run_ops(spec, backend, runs, named)
    if runs.cp_size > 1:
        return run_cp(spec, original, runs, named)
    want_state = bool(named.get(spec.state_flag)) if spec.state_flag else False
    rows_out, states = [], []
    for row in runs.rows:
        pieces = []
        for frag in row:
            out, state = call_fragment(spec, original, named, frag.row, frag.start, frag.length)
            pieces.append(out)
        states.append(state)
        out_row = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=time_axis(pieces[0], spec.out_dim))
        rows_out.append(out_row)
    out = rows_out[0] if len(rows_out) == 1 else torch.cat(rows_out, dim=0)
    if spec.returns_tuple:
        return out, (torch.cat(states, 0) if want_state else None)
    return (out, torch.cat(states, 0)) if want_state else out


def check_signature(spec: ScanFunction, function: Callable) -> None:
    """Raise ``TypeError`` if ``function``'s parameters do not start with ``spec.params`` (a transformers upgrade
    changed the function this package replaces)."""
    params = tuple(inspect.signature(function).parameters)
    if params[:len(spec.params)] != spec.params:
        raise TypeError(f"transformers' {spec.name} now takes {params}; blockdiag_cp was written for {spec.params}")


def uninstall_recurrent(model: torch.nn.Module) -> None:
    """Give every served wrapper of ``model`` its original ``forward`` back."""
    for module in model.modules():
        if module.__dict__.pop(INSTALLED_ATTR, None) is not None:
            for key in ("forward", _PROBE_KEY):
                module.__dict__.pop(key, None)
        for wrapper in (mixer_functions(module) or {}).values():
            if wrapper.__dict__.pop(INSTALLED_ATTR, None) is not None:
                for key in ("forward", _PROBE_KEY, _NAME_KEY):
                    wrapper.__dict__.pop(key, None)
