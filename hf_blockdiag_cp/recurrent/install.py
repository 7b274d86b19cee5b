"""Serving transformers' recurrent mixers per document: what :func:`~hf_blockdiag_cp.model.prepare_model` installs.

For every mixer of a model that carries private kernel wrappers (``use_kernelized_func``, see :mod:`.functions`),
the wrapper of each served scan gets an instance ``forward`` (as ``kernels.kernelize`` does) that

- passes the call through unchanged when the forward has one document per row (generation, unpacked batches);
- otherwise runs the model's own function once per fragment (:mod:`.runs`) with a zero initial state, so every
  scan and causal convolution restarts at each document start (CP = 1), or hands the fragment summaries
  between CP ranks (:mod:`.state_passing`, CP > 1), or, with ``recurrent_layout="heads"``, splits the call's
  heads over the CP ranks and runs whole documents (:mod:`.head_parallel`).

The fragments come from the forward's preparation (the model pre-hook stores them in the probe), so a decoder
layer that drops the model's keyword arguments (jamba, mamba, falcon_mamba) is served as well as one that
passes them. Fused GPU paths (:data:`~.functions.FUSED`) are skipped with packed rows (they return ``None``,
as their torch stand-ins do, and the layer runs its unfused, served path). A windowed module
(:data:`~.functions.WINDOWED`, or its plain ``nn.Conv1d`` child) gets an instance ``forward`` that runs it once per
fragment (:func:`~.state_passing.run_window`). A mixer whose scan is an instance method (:data:`~.functions.METHODS`)
gets an instance attribute of that name, served like a wrapper's ``forward``. A mixer whose recurrence runs inside its
own ``forward`` (:data:`~.functions.STATEFUL`) gets an instance ``forward`` that runs it whole once per fragment
(:func:`~.state_passing.run_stateful`).
"""

from __future__ import annotations

import inspect
from types import MethodType
from typing import Any, Callable

import torch

from ..errors import UnsupportedModel
from .agreement import agree_recurrent
from .backend import call_backend, op_refusal
from .fragment_call import bind, call_fragment, time_axis
from .functions import (
    COMPOSITES,
    FUSED,
    METHODS,
    SCAN_MODULES,
    SCANS,
    STATEFUL,
    WINDOWED,
    ScanFunction,
    conv_window,
    mixer_functions,
)
from .head_parallel import run_heads
from .op_call import known_arguments, run_ops
from .runs import LocalRuns
from .scan_modules import run_scan_module
from .state_passing import run_cp, run_stateful, run_window

__all__ = ["INSTALLED_ATTR", "install_recurrent", "is_served", "served_modules", "uninstall_recurrent",
           "unserved_functions"]

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
    """Whether ``module`` is a recurrent mixer whose every scan is served per fragment (or a windowed module, or a
    mixer whose scan method is served). The ``nn.Conv1d`` child of a windowed owner: :func:`served_modules`."""
    cls_name = type(module).__name__
    if cls_name in WINDOWED:
        return WINDOWED[cls_name].child is None
    if cls_name in METHODS:
        return callable(getattr(module, METHODS[cls_name].name, None))
    if cls_name in SCAN_MODULES:
        return True
    if cls_name in STATEFUL:  # the attributes its summary reads (a rename refuses the model instead of failing later)
        spec = STATEFUL[cls_name]
        return all(hasattr(module, a) for a in (spec.layer_attr, spec.heads_attr, spec.dim_attr, spec.rate_attr))
    funcs = mixer_functions(module)
    return funcs is not None and any(name in SCANS for name in funcs) and not unserved_functions(module)


def _served_child(module: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """``(attribute, conv)`` when ``module`` owns a plain causal ``nn.Conv1d`` served per fragment (``WINDOWED``)."""
    spec = WINDOWED.get(type(module).__name__)
    if spec is None or spec.child is None:
        return None
    child = getattr(module, spec.child, None)
    return (spec.child, child) if conv_window(child) is not None else None


def served_modules(model: torch.nn.Module) -> list[str]:
    """Names (as in ``named_modules``) of ``model``'s submodules served per document fragment."""
    names = []
    for name, module in model.named_modules():
        if is_served(module):
            names.append(name)
        child = _served_child(module)
        if child is not None:
            names.append(f"{name}.{child[0]}" if name else child[0])
    return names


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
        cls_name = type(module).__name__
        child = _served_child(module)
        if child is not None:
            count += 1
            _install(child[1], "forward", _window_forward, probe, cls_name)
            continue
        if not is_served(module):
            continue
        count += 1
        if cls_name in WINDOWED:
            _install(module, "forward", _window_forward, probe, cls_name)
            continue
        if cls_name in METHODS:
            _install(module, METHODS[cls_name].name, _method_forward, probe, cls_name)
            continue
        if cls_name in STATEFUL:
            _install(module, "forward", _stateful_forward, probe, cls_name)
            continue
        if cls_name in SCAN_MODULES:
            _install(module, "forward", _scan_module_forward, probe, cls_name)
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
#: On a served module: the attribute its instance shadows (``forward``, or a :data:`~.functions.METHODS` name).
_ATTR_KEY = "_blockdiag_cp_attr"


def _install(module: torch.nn.Module, attr: str, forward: Callable, probe: Any, key: str) -> None:
    """Shadow ``module.<attr>`` by ``forward`` bound to ``module`` (its original kept; idempotent); ``key``: the
    table entry (class name) that serves it."""
    module.__dict__[_PROBE_KEY] = probe
    if INSTALLED_ATTR in module.__dict__:
        return
    module.__dict__[INSTALLED_ATTR] = getattr(module, attr)
    module.__dict__[_NAME_KEY] = key
    module.__dict__[_ATTR_KEY] = attr
    module.__dict__[attr] = MethodType(forward, module)


def _held_runs(probe: Any) -> LocalRuns | None:
    """The fragments of the forward in progress (or being recomputed in backward); ``None`` for one document per
    row and for a later direct call of a submodule, whose model pre-hook did not run."""
    return probe.runs if probe.holds_step() else None


def _served_call(self: torch.nn.Module) -> tuple[Callable, LocalRuns | None, Any]:
    """``(original callable, fragments of the forward in progress or None, probe)`` of a served wrapper or module."""
    probe = self.__dict__[_PROBE_KEY]
    return self.__dict__[INSTALLED_ATTR], _held_runs(probe), probe


def _fused_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    if _held_runs(self.__dict__[_PROBE_KEY]) is not None:
        # The fused kernel runs the whole row in one call (state across documents). ``None`` is what its torch
        # stand-in returns: every layer calling it then takes its unfused path, whose scans are served.
        return None
    return self.__dict__[INSTALLED_ATTR](*args, **kwargs)


def _scan_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    original, runs, probe = _served_call(self)
    if runs is None:
        return original(*args, **kwargs)
    probe.attention_calls += 1
    return run_fragments(SCANS[self.__dict__[_NAME_KEY]], original, runs, args, kwargs)


def _method_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A :data:`~.functions.METHODS` scan method: the original, or once per fragment with packed rows."""
    original, runs, probe = _served_call(self)
    if runs is None:
        return original(*args, **kwargs)
    probe.attention_calls += 1
    return run_fragments(METHODS[self.__dict__[_NAME_KEY]], original, runs, args, kwargs)


def _stateful_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A :data:`~.functions.STATEFUL` module: the original, or once per fragment with packed rows."""
    original, runs, probe = _served_call(self)
    if runs is None:
        return original(*args, **kwargs)
    probe.attention_calls += 1
    spec = STATEFUL[self.__dict__[_NAME_KEY]]
    named = bind(spec, args, kwargs)
    for key in _PACKING_KEYWORDS:  # the fragments replace them
        named.pop(key, None)
    cache = named.pop(spec.cache, None)
    layer = getattr(self, spec.layer_attr)
    if cache is not None and (runs.cp_size > 1 or getattr(cache, spec.cache_get)(layer) is not None):
        raise UnsupportedModel(f"{spec.name} got a cache with packed rows under context parallelism or holding a "
                               "state; blockdiag_cp trains packed rows without a cache (pass use_cache=False)")
    lead = named[spec.sequence]
    if lead.shape[0] != runs.batch_size or lead.shape[1] != runs.local_len:
        raise ValueError(f"{spec.name} got rows [B={lead.shape[0]}, T={lead.shape[1]}] but this forward's packed "
                         f"batch has [B={runs.batch_size}, L={runs.local_len}]")
    if runs.cp_size > 1:
        agree_recurrent(runs.context, lead.device)
    out, ends = run_stateful(spec, self, original, runs, named)
    if cache is not None:  # a prefill: each row's state is its last fragment's, as the stock forward leaves it
        getattr(cache, spec.cache_set)(layer, ends)
    return out, ends


def _scan_module_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A :data:`~.functions.SCAN_MODULES` module: the original, or once per fragment with packed rows."""
    original, runs, probe = _served_call(self)
    if runs is None:
        return original(*args, **kwargs)
    probe.attention_calls += 1
    spec = SCAN_MODULES[self.__dict__[_NAME_KEY]]
    named = bind(spec, args, kwargs)
    lead = named[next(iter(spec.time_args))]
    length = lead.shape[spec.time_args[next(iter(spec.time_args))]]
    if lead.shape[0] != runs.batch_size or length != runs.local_len:
        raise ValueError(f"{spec.name} got rows [B={lead.shape[0]}, T={length}] but this forward's packed batch has "
                         f"[B={runs.batch_size}, L={runs.local_len}]")
    # xLSTM's backend returns its last states in inference mode always, in training modes when asked (its config's
    # default when the call does not say).
    mode = named.get("mode") or self.config.mode
    want = named.get(spec.state_flag)
    returns_states = "inference" in mode or bool(self.config.return_last_states if want is None else want)
    if runs.cp_size > 1:
        agree_recurrent(runs.context, lead.device)
    return run_scan_module(spec, original, runs, named, returns_states)


def _window_forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    original, runs, probe = _served_call(self)
    if runs is None:
        return original(*args, **kwargs)
    spec = WINDOWED[self.__dict__[_NAME_KEY]]
    named = bind(spec, args, kwargs)
    for key in _PACKING_KEYWORDS:  # the fragments replace them (a module reading seq_idx would reset twice)
        named.pop(key, None)
    if spec.cache is not None and named.get(spec.cache) is not None:
        raise UnsupportedModel(f"{spec.name} got a cache with packed rows; blockdiag_cp trains packed rows without a "
                               "cache (pass use_cache=False)")
    window = conv_window(self) if spec.window_attr is None else max(1, int(getattr(self, spec.window_attr)))
    lead = named[spec.sequence]
    length = lead.shape[time_axis(lead, spec.time_dim)]
    if lead.shape[0] != runs.batch_size or length != runs.local_len:
        raise ValueError(f"{spec.name} got rows [B={lead.shape[0]}, T={length}] but this forward's packed "
                         f"batch has [B={runs.batch_size}, L={runs.local_len}]")
    if runs.cp_size > 1:
        agree_recurrent(runs.context, lead.device)
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
    if runs.cp_size > 1:
        agree_recurrent(runs.context, lead.device)  # before this step's first recurrent collective
        if runs.context.config.recurrent_layout == "heads":  # whole documents per rank: the model's own function
            return run_heads(spec, original, runs, named)
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
            for key in (module.__dict__.pop(_ATTR_KEY, "forward"), _PROBE_KEY, _NAME_KEY):
                module.__dict__.pop(key, None)
        for wrapper in (mixer_functions(module) or {}).values():
            if wrapper.__dict__.pop(INSTALLED_ATTR, None) is not None:
                for key in ("forward", _PROBE_KEY, _NAME_KEY):
                    wrapper.__dict__.pop(key, None)
