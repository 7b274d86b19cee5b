"""The entry of every served recurrent call: check it, agree once per step, pick a runner, run :mod:`.driver`.

The integration layer (:mod:`hf_blockdiag_cp.mixer_hooks`) binds a call's arguments and hands them here with the
forward's fragments (:class:`~.runs.LocalRuns`); nothing here knows transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import UnsupportedModel
from .backend import call_backend, op_refusal
from .driver import run_fragments
from .head_parallel import run_heads
from .module_runners import ScanModuleRunner, StatefulRunner, WindowRunner
from .runs import LocalRuns
from .scan_runner import ScanRunner, known_arguments
from .specs import ScanFunction, ScanModule, StatefulModule, WindowedModule, time_axis

__all__ = ["serve_scan", "serve_scan_module", "serve_stateful", "serve_window"]

_NO_CACHE = "blockdiag_cp trains packed rows without a cache (pass use_cache=False)"


def _start(name: str, lead: torch.Tensor, dim: int, runs: LocalRuns) -> None:
    """The call's rows must be the forward's packed rows; under CP, the step's agreement before its first collective."""
    length = lead.shape[time_axis(lead, dim)]
    if lead.shape[0] != runs.batch_size or length != runs.local_len:
        raise ValueError(f"{name} got rows [B={lead.shape[0]}, T={length}] but this forward's packed batch has "
                         f"[B={runs.batch_size}, L={runs.local_len}]")
    if runs.plan is not None:
        runs.agree(lead.device)


def serve_scan(spec: ScanFunction, original: Callable, runs: LocalRuns, named: dict[str, Any]) -> Any:
    """A scan function (:data:`~hf_blockdiag_cp.mixer_table.SCANS`, :data:`~hf_blockdiag_cp.mixer_table.METHODS`)."""
    if spec.state_in is not None and named.get(spec.state_in) is not None:
        raise UnsupportedModel(f"{spec.name} got an initial state (a cache) with packed rows; {_NO_CACHE}")
    final = bool(named.get(spec.state_flag)) if spec.state_flag else False
    if final and runs.plan is not None:
        raise UnsupportedModel(f"{spec.name}: a final state (a cache) under context parallelism is not implemented; "
                               "pass use_cache=False when training")
    first = next(iter(spec.time_args))
    _start(spec.name, named[first], spec.time_args[first], runs)
    if runs.plan is not None and runs.context.config.recurrent_layout == "heads":
        return run_heads(spec, original, runs, named)  # whole documents per rank: the model's own function
    lead = named[first]
    backend = call_backend(runs.backend, spec.kind, lead.device)
    if backend != "model" and op_refusal(spec.kind, named, known_arguments(spec)) is not None:
        backend = "model"
    with runs.guard(f"recurrent {spec.name} ({backend})"):
        return run_fragments(ScanRunner(spec, original, named, backend, final, runs.local), runs, lead.device)


def serve_window(spec: WindowedModule, original: Callable, runs: LocalRuns, named: dict[str, Any],
                 width: int) -> Any:
    """A windowed module (``width``: earlier inputs an output reads)."""
    if spec.cache is not None and named.get(spec.cache) is not None:
        raise UnsupportedModel(f"{spec.name} got a cache with packed rows; {_NO_CACHE}")
    lead = named[spec.sequence]
    _start(spec.name, lead, spec.time_dim, runs)
    with runs.guard(f"recurrent {spec.name}"):
        return run_fragments(WindowRunner(spec, original, named, width, runs.local), runs, lead.device)


def serve_stateful(spec: StatefulModule, module: torch.nn.Module, original: Callable, runs: LocalRuns,
                   named: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A module with its recurrence inside (``named`` without its cache): ``(out, each row's end state or None)``."""
    lead = named[spec.sequence]
    _start(spec.name, lead, 1, runs)
    with runs.guard(f"recurrent {spec.name}"):
        return run_fragments(StatefulRunner(spec, module, original, named, runs.local), runs, lead.device)


def serve_scan_module(spec: ScanModule, original: Callable, runs: LocalRuns, named: dict[str, Any],
                      returns_states: bool) -> Any:
    """A module that is one scan taking its initial states (``returns_states``: the call returns its last states)."""
    if any(named.get(name) is not None for name in spec.state_in):
        raise UnsupportedModel(f"{spec.name} got an initial state (a cache) with packed rows; {_NO_CACHE}")
    if runs.plan is not None and not returns_states:
        raise UnsupportedModel(f"{spec.name} does not return its last states here (return_last_states=False, e.g. "
                               "xLSTM's train_with_padding mode): the state passing between CP ranks needs them")
    first = next(iter(spec.time_args))
    _start(spec.name, named[first], spec.time_args[first], runs)
    with runs.guard(f"recurrent {spec.name}"):
        return run_fragments(ScanModuleRunner(spec, original, named, returns_states, runs.local), runs,
                             named[first].device)
