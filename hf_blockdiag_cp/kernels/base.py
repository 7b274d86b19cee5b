"""The one contract every attention backend implements.

A backend module exposes ``NAME``, ``CAPABILITIES`` (a :class:`Capabilities`: what it can run, from which
its availability for a spec is derived without launching a kernel) and ``attention(q, k, v, call) -> out``:

- ``q``  ``[Tq, Hq, D]``: packed query rows of every segment, in plan order;
- ``k``, ``v`` ``[Tk, Hkv, D]`` / ``[Tk, Hkv, Dv]``: packed key/value rows (``Hkv`` divides ``Hq``;
  K/V heads are never repeated by the caller);
- ``call.plan``: the device-resident :class:`~hf_blockdiag_cp.planning.VarlenPlan` (int32
  ``cu_seqlens_q/k``, exact ``max_seqlen_q/k``, host-side segment lengths for scheduling);
- ``call.schedules``: the :class:`PlanSchedules` of that plan, where a backend keeps what it derives
  from the plan (built by the first layer of a step, reused by the others and by recompute);
- semantics: per segment, bottom-right causal attention (query ``i`` of a segment with ``q_len``
  queries and ``k_len`` keys sees keys ``j <= k_len - q_len + i``), optionally limited to a
  sliding window of ``window`` keys (``j > k_len - q_len + i - window``, transformers' convention);
  with ``call.causal`` False (the non-causal part of a plan with bidirectional blocks, declared by
  ``Capabilities.noncausal``), every query of a segment sees all its keys and there is no window;
- optional features, each declared in ``CAPABILITIES`` (a backend that lacks one is not chosen): ``Dv != D``
  (``KernelSpec.value_dim``), logit softcapping (``softcap * tanh(scale * q.k / softcap)`` before the
  mask and softmax, gemma2), attention sinks (``KernelCall.sinks [Hq]``: one learned logit per query
  head that joins every row's softmax denominator and carries no value, gpt-oss ``s_aux``);
- returns ``[Tq, Hq, Dv]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, TypeVar

import torch

from ..errors import BackendUnavailable
from ..planning import VarlenPlan
from ._imports import optional_import

__all__ = ["BackendUnavailable", "Capabilities", "KernelCall", "KernelSpec", "PlanSchedules", "TokenCoordinates"]

T = TypeVar("T")


@dataclass(frozen=True)
class KernelSpec:
    """What a backend must support for one attention call (all host-side facts, no tensors)."""

    device_type: str
    dtype: torch.dtype
    head_dim: int
    value_dim: int
    num_q_heads: int
    num_kv_heads: int
    dropout_p: float = 0.0
    window: int | None = None
    softcap: float | None = None
    requires_grad: bool = False
    sinks: bool = False  # whether the call passes KernelCall.sinks
    noncausal: bool = False  # whether the plan has non-causal segments (bidirectional blocks)


class TokenCoordinates(NamedTuple):
    """Per packed row, on the plan's device: ``q_seg [Tq]``, ``q_pos [Tq]``, ``k_seg [Tk]``, ``k_pos [Tk]``
    int64 (see :func:`token_coordinates`)."""

    q_seg: torch.Tensor
    q_pos: torch.Tensor
    k_seg: torch.Tensor
    k_pos: torch.Tensor


@dataclass(eq=False)
class PlanSchedules:
    """What backends derive from one device-resident plan, each built at most once per plan.

    Not data: the owner of the plan for a step keeps it next to the plan (the attention layers'
    :class:`~hf_blockdiag_cp.runtime.StepRuntime`, or a forward's mask for plans derived from
    keyword arguments), so every layer and every activation-checkpoint recompute reuses it.

    Attributes:
        token_coordinates: per packed row, segment and position (dense-mask backends).
        by_backend: what each backend derives, keyed by ``(backend NAME, key)`` (e.g. the sliding window);
            this module knows no backend's schedule type (a backend is one module).
    """

    token_coordinates: TokenCoordinates | None = None
    by_backend: dict[tuple[str, Any], Any] = field(default_factory=dict)
    parts: dict[int, PlanSchedules] = field(default_factory=dict)

    def part(self, index: int) -> PlanSchedules:
        """The schedules of part ``index`` of a plan with bidirectional blocks (``VarlenPlan.parts``)."""
        if index not in self.parts:
            self.parts[index] = PlanSchedules()
        return self.parts[index]

    def get(self, backend: str, key: Any, build: Callable[[], T]) -> T:
        """``backend``'s schedule for ``key``, built by ``build()`` the first time it is asked for."""
        slot = (backend, key)
        if slot not in self.by_backend:
            self.by_backend[slot] = build()
        return self.by_backend[slot]


@dataclass(frozen=True, eq=False)
class KernelCall:
    """Everything a backend needs besides the packed tensors (``schedules``: the plan's, or a fresh one
    that nothing else reuses)."""

    plan: VarlenPlan
    scale: float
    dropout_p: float = 0.0
    window: int | None = None
    softcap: float | None = None
    deterministic: bool = False
    flash_prefix_guard: bool = True
    # [Hq] attention-sink logits (any float dtype; gradients flow back to it), or None.
    sinks: torch.Tensor | None = None
    schedules: PlanSchedules = field(default_factory=PlanSchedules, repr=False)
    # False: every query of a segment sees all the segment's keys (bidirectional blocks; ``window`` is None).
    causal: bool = True

    @property
    def causal_window(self) -> tuple[int, int]:
        """``(left, right)`` window in the flash convention: ``(-1, 0)`` causal, ``(w - 1, 0)`` windowed."""
        return (-1, 0) if self.window is None else (self.window - 1, 0)


def reject_unsupported(call: KernelCall, backend: str, *, softcap: bool = False, sinks: bool = False,
                       noncausal: bool = False) -> None:
    """Raise :class:`BackendUnavailable` when ``call`` asks ``backend`` for a feature it lacks (the
    availability check should have said so; this keeps a direct call from silently ignoring it)."""
    if not call.causal and not noncausal:
        raise BackendUnavailable(f"backend {backend!r} has no non-causal segments (bidirectional blocks)")
    if call.softcap is not None and not softcap:
        raise BackendUnavailable(f"backend {backend!r} has no logit softcapping (softcap={call.softcap})")
    if call.sinks is not None and not sinks:
        raise BackendUnavailable(f"backend {backend!r} has no attention sinks")


HALF_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Capabilities:
    """What one backend can compute: the one place its availability is declared (see :mod:`hf_blockdiag_cp.kernels`).

    :meth:`unavailable_reason` derives from it why a :class:`KernelSpec` cannot run (``None``: it can), so no
    backend re-checks devices, dtypes or features by hand.

    Attributes:
        name: the backend's name (``BlockDiagCPConfig.backend``).
        library: how messages name the kernel.
        module: an optional library that must import (``None``: nothing optional); ``module_attr``: a name it
            must have.
        devices: device types it runs on (``None``: any).
        dtypes: dtypes it runs (``None``: any floating dtype).
        max_head_dim: the largest head dim (``None``: no limit).
        value_dim: whether it runs ``Dv != D``; dropout, softcap, sinks: whether it applies them;
            dropout_with_extras: whether dropout combines with softcap or sinks.
        noncausal: whether it runs non-causal segments (``KernelCall.causal=False``: bidirectional blocks);
            noncausal_with_extras: whether those combine with softcap or sinks.
        cpu_backward: whether it has a backward on CPU (``False``: inference only there).
        auto: its preference rank for ``backend="auto"`` per device type (``"default"``: any other device);
            absent: never picked automatically unless as a last resort.
        last_resort: its rank among the backends ``"auto"`` takes when no preferred one can run (``None``: never).
    """

    name: str
    library: str
    module: str | None = None
    module_attr: str | None = None
    devices: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    max_head_dim: int | None = None
    value_dim: bool = True
    dropout: bool = True
    softcap: bool = True
    sinks: bool = True
    dropout_with_extras: bool = True
    noncausal: bool = False
    noncausal_with_extras: bool = True
    cpu_backward: bool = True
    auto: dict[str, int] = field(default_factory=dict)
    last_resort: int | None = None

    def unavailable_reason(self, spec: KernelSpec) -> str | None:
        """Why this backend cannot run ``spec`` (cheap: an import, then host facts), or ``None``."""
        lib = self.library
        if self.module is not None:
            module, reason = optional_import(self.module)
            if module is None:
                return reason
            if self.module_attr is not None and not hasattr(module, self.module_attr):
                return f"{self.module}.{self.module_attr} is missing in this install"
        if self.devices is not None and spec.device_type not in self.devices:
            if self.devices == ("cuda",):
                return f"{lib} runs on CUDA only, not {spec.device_type}"
            return f"{lib} is not supported on {spec.device_type}"
        if self.dtypes is None and not spec.dtype.is_floating_point:
            return f"{lib} needs a floating dtype, got {spec.dtype}"
        if self.dtypes is not None and spec.dtype not in self.dtypes:
            wanted = "/".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"{lib} needs {wanted}, got {spec.dtype}"
        if not self.cpu_backward and spec.device_type == "cpu" and spec.requires_grad:
            return f"{lib} has no CPU backward in this torch"
        if not self.dropout and spec.dropout_p > 0:
            return f"{lib} has no dropout"
        if not self.softcap and spec.softcap is not None:
            return f"{lib} has no logit softcapping"
        too_large = self.max_head_dim is not None and spec.head_dim > self.max_head_dim
        if too_large or (not self.value_dim and spec.head_dim != spec.value_dim):
            limit = "" if self.max_head_dim is None else f" <= {self.max_head_dim}"
            return f"{lib} needs head_dim == value_dim{limit}, got {spec.head_dim}/{spec.value_dim}"
        if not self.sinks and spec.sinks:
            return f"{lib} has no attention sinks"
        if not self.dropout_with_extras and spec.dropout_p > 0 and (spec.softcap is not None or spec.sinks):
            return f"{lib} applies no dropout together with logit softcapping or attention sinks"
        if spec.noncausal and not self.noncausal:
            return f"{lib} has no non-causal segments (bidirectional blocks)"
        if spec.noncausal and not self.noncausal_with_extras and (spec.softcap is not None or spec.sinks):
            return f"{lib} has no non-causal segments (bidirectional blocks) with logit softcapping or attention sinks"
        return None


def token_coordinates(call: KernelCall) -> TokenCoordinates:
    """Per packed row of ``call.plan``: ``(q_seg [Tq], q_pos [Tq], k_seg [Tk], k_pos [Tk])`` on the plan's device.

    ``q_pos`` is a query's position inside its segment's keys (``k_len - q_len + i``), so a query
    sees a key iff same segment, ``k_pos <= q_pos`` and, with a window, ``k_pos > q_pos - window``.
    Built once on the host and kept in ``call.schedules`` (dense-mask style backends only).
    """
    schedules = call.schedules
    if schedules.token_coordinates is None:
        schedules.token_coordinates = _token_coordinates(call.plan)
    return schedules.token_coordinates


def _token_coordinates(plan: VarlenPlan) -> TokenCoordinates:
    q_lens = torch.tensor([s.q_len for s in plan.segments], dtype=torch.int64)
    k_lens = torch.tensor([s.k_len for s in plan.segments], dtype=torch.int64)
    seg = torch.arange(len(plan.segments))
    q_seg = torch.repeat_interleave(seg, q_lens)
    k_seg = torch.repeat_interleave(seg, k_lens)
    q_first = torch.tensor(plan.host_cu_q[:-1], dtype=torch.int64)
    k_first = torch.tensor(plan.host_cu_k[:-1], dtype=torch.int64)
    q_pos = torch.arange(plan.total_q) - q_first[q_seg] + (k_lens - q_lens)[q_seg]
    k_pos = torch.arange(plan.total_k) - k_first[k_seg]
    return TokenCoordinates(*(t.to(plan.device) for t in (q_seg, q_pos, k_seg, k_pos)))


def visible(q_seg: torch.Tensor, q_pos: torch.Tensor, k_seg: torch.Tensor, k_pos: torch.Tensor,
            window: int | None, causal: bool = True) -> torch.Tensor:
    """Boolean visibility for broadcastable query/key coordinates (see :func:`token_coordinates`); not
    ``causal``: every key of the query's segment."""
    if not causal:
        return q_seg == k_seg
    allowed = (q_seg == k_seg) & (k_pos <= q_pos)
    if window is not None:
        allowed = allowed & (k_pos > q_pos - window)
    return allowed
