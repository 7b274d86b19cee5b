"""Serving transformers' recurrent mixers per document: the instance hooks :func:`~hf_blockdiag_cp.model.prepare_model`
installs (the integration layer, beside the attention registration in :mod:`.integration`).

For every mixer of a model listed in :mod:`.mixer_table`, the served callable gets an instance attribute (as
``kernels.kernelize`` does for a ``use_kernelized_func`` wrapper's ``forward``) that

- passes the call through unchanged when the forward has one document per row (generation, unpacked batches);
- otherwise binds the call's arguments, drops the packing keywords (the fragments replace them) and hands it to
  :mod:`hf_blockdiag_cp.recurrent.serve` with the forward's fragments (:class:`~.recurrent.runs.LocalRuns`).

The fragments come from the forward's preparation (the model pre-hook; during an activation-checkpoint recompute,
the forward the recomputed layer belongs to, :mod:`.model.forward_runs`), so a decoder layer that drops the
model's keyword arguments (jamba, mamba, falcon_mamba) is served as well as one that passes them. Fused GPU paths
(:data:`~.mixer_table.FUSED`) are skipped with packed rows (they return ``None``, as their torch stand-ins do,
and the layer runs its unfused, served path).
"""

from __future__ import annotations

import inspect
from types import MethodType
from typing import Any, Callable

import torch

from .compat import kernel_functions as mixer_functions
from .errors import UnsupportedModel
from .mixer_table import COMPOSITES, FUSED, METHODS, SCAN_MODULES, SCANS, STATEFUL, WINDOWED, conv_window
from .recurrent.runs import LocalRuns
from .recurrent.serve import serve_scan, serve_scan_module, serve_stateful, serve_window
from .recurrent.specs import ScanFunction, bind

__all__ = ["INSTALLED_ATTR", "check_signature", "install_recurrent", "is_served", "served_modules",
           "uninstall_recurrent",
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
            _install(module, METHODS[cls_name].name, _scan_forward, probe, cls_name)
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
    return probe.held("a recurrent mixer").runs if probe.holds_step() else None


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


def _bound(self: torch.nn.Module, spec: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name, without the packing keywords (the fragments replace them: a module reading
    ``seq_idx`` would reset twice)."""
    named = bind(spec.params, spec.name, args, kwargs)
    for key in _PACKING_KEYWORDS:
        named.pop(key, None)
    return named


def _served(lookup: Callable[[str], Any], serve: Callable[..., Any], counted: bool = True) -> Callable[..., Any]:
    """An instance forward: the original when the forward has one document per row, else ``serve(self, spec,
    original, runs, args, kwargs)`` with the table entry ``lookup(name)`` (``counted``: a call of the package's token
    mixing, so that a packed forward of a model without attention layers is not refused)."""

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        original, runs, probe = _served_call(self)
        if runs is None:
            return original(*args, **kwargs)
        if counted:
            probe.attention_calls += 1
        return serve(self, lookup(self.__dict__[_NAME_KEY]), original, runs, args, kwargs)

    return forward


def _serve_scan(self: torch.nn.Module, spec: ScanFunction, original: Callable, runs: LocalRuns, args: tuple,
                kwargs: dict[str, Any]) -> Any:
    """A served scan (a wrapper's ``forward`` or a :data:`~.mixer_table.METHODS` method)."""
    return serve_scan(spec, original, runs, _bound(self, spec, args, kwargs))


def _serve_stateful(self: torch.nn.Module, spec: Any, original: Callable, runs: LocalRuns, args: tuple,
                    kwargs: dict[str, Any]) -> Any:
    """A :data:`~.mixer_table.STATEFUL` module; a prefill's cache gets each row's end state."""
    named = _bound(self, spec, args, kwargs)
    cache = named.pop(spec.cache, None)
    layer = getattr(self, spec.layer_attr)
    if cache is not None and (runs.cp_size > 1 or getattr(cache, spec.cache_get)(layer) is not None):
        raise UnsupportedModel(f"{spec.name} got a cache with packed rows under context parallelism or holding a "
                               "state; blockdiag_cp trains packed rows without a cache (pass use_cache=False)")
    out, ends = serve_stateful(spec, self, original, runs, named)
    if cache is not None:  # a prefill: each row's state is its last fragment's, as the stock forward leaves it
        getattr(cache, spec.cache_set)(layer, ends)
    return out, ends


def _serve_scan_module(self: torch.nn.Module, spec: Any, original: Callable, runs: LocalRuns, args: tuple,
                       kwargs: dict[str, Any]) -> Any:
    """A :data:`~.mixer_table.SCAN_MODULES` module (whether the call returns its last states: the row's rule)."""
    named = bind(spec.params, spec.name, args, kwargs)
    returns = spec.returns_states
    returns_states = bool(named.get(spec.state_flag)) if returns is None else returns(self, named)
    return serve_scan_module(spec, original, runs, named, returns_states)


def _serve_window(self: torch.nn.Module, spec: Any, original: Callable, runs: LocalRuns, args: tuple,
                  kwargs: dict[str, Any]) -> Any:
    """A :data:`~.mixer_table.WINDOWED` module (or its ``nn.Conv1d`` child)."""
    width = conv_window(self) if spec.window_attr is None else max(1, int(getattr(self, spec.window_attr)))
    return serve_window(spec, original, runs, _bound(self, spec, args, kwargs), width)


_scan_forward = _served(lambda name: METHODS[name] if name in METHODS else SCANS[name], _serve_scan)
_stateful_forward = _served(STATEFUL.__getitem__, _serve_stateful)
_scan_module_forward = _served(SCAN_MODULES.__getitem__, _serve_scan_module)
_window_forward = _served(WINDOWED.__getitem__, _serve_window, counted=False)


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
