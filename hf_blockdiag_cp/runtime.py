"""The one home of per-step run-time state: what a step's forwards and layers derive from its context (not data).

A :class:`~hf_blockdiag_cp.context.BlockDiagCPContext` and its plans are frozen host data. What one step
builds from them lives here, in one :class:`StepRuntime` per context: the plans' device copies with the
kernel schedules derived from them, the CP ranks' agreement, the backend chosen per kernel spec, this
rank's device-ready K/V exchanges and the bytes they moved (filled by the first attention layer, reused by
every later layer and activation-checkpoint recompute), and the number of model forwards run on the context
(counted by the model's pre-hook, :mod:`hf_blockdiag_cp.model.forward_agreement`).

This module sits below both :mod:`hf_blockdiag_cp.attention` and :mod:`hf_blockdiag_cp.model`; any token
mixer that runs on a context (attention today, recurrent layers next) keeps its per-step state here.
:func:`owner` is the one lookup from a context to the context that owns its state (``ctx.origin or ctx``:
``origin`` is the context a device copy was made from); :func:`step_runtime` keys a weak map owned by this
module by that owner, so a context and all its device copies share one runtime, created on first use, and
it goes away with the context. Nothing here references a context, so the weak map never keeps one alive.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .context import BlockDiagCPContext
from .distributed import CommStats, RankExchange
from .distributed.ulysses import HeadA2A
from .kernels import KernelSpec
from .kernels.base import PlanSchedules
from .planning import VarlenPlan

__all__ = ["DevicePlan", "PlanKey", "StepRuntime", "device_plan", "find_runtime", "owner", "plan_key",
           "step_runtime"]


class PlanKey(NamedTuple):
    """A device and a planned sliding window (``None``: the full plans) of one step."""

    device: torch.device
    window: int | None


@dataclass(eq=False)
class DevicePlan:
    """A plan on the device of the layers that run it, with what kernels derive from it."""

    plan: VarlenPlan
    schedules: PlanSchedules = field(default_factory=PlanSchedules)


@dataclass(eq=False)
class StepRuntime:
    """What the layers of one step derive from its context and reuse.

    Attributes:
        plans: the context's plans on each device, per planned window (:func:`device_plan`).
        agreed_backends: backends every CP rank can run (the step's rank agreement), once known.
        backends: the backend chosen per kernel spec in this step.
        exchanges: this rank's device-ready exchange per device and planned window (``None``: nothing moves).
        comm: bytes moved by this step's K/V exchanges (and head all-to-alls).
        media: bytes moved by this step's image / video feature all-to-all (:mod:`hf_blockdiag_cp.model.media`).
        head_a2a: this rank's head all-to-all per device (``ulysses_size > 1`` only).
        forwards: model forwards this rank ran on the context (the forward agreement's counter; a
            gradient-checkpoint recompute runs the layers only and is not counted).
        fragments: the step's :class:`~hf_blockdiag_cp.planning.fragments.FragmentPlan` for recurrent layers
            (CP > 1), planned on first use.
        recurrent: what recurrent layers build once per step and reuse (owned by :mod:`hf_blockdiag_cp.recurrent`:
            the agreement's flag, the head-parallel fallback's all-to-alls and row orders per device).
    """

    plans: dict[PlanKey, DevicePlan] = field(default_factory=dict)
    agreed_backends: frozenset[str] | None = None
    backends: dict[KernelSpec, str] = field(default_factory=dict)
    exchanges: dict[PlanKey, RankExchange | None] = field(default_factory=dict)
    comm: CommStats = field(default_factory=CommStats)
    media: CommStats = field(default_factory=CommStats)
    head_a2a: dict[torch.device, HeadA2A] = field(default_factory=dict)
    forwards: int = 0
    fragments: Any = None
    recurrent: dict[Any, Any] = field(default_factory=dict)


#: The runtime of every live context (by identity: contexts compare by identity), the module's one cache.
_RUNTIMES: weakref.WeakKeyDictionary[BlockDiagCPContext, StepRuntime] = weakref.WeakKeyDictionary()


def owner(ctx: BlockDiagCPContext) -> BlockDiagCPContext:
    """The context that owns ``ctx``'s step state: the context its device copy was made from, else itself."""
    return ctx if ctx.origin is None else ctx.origin


def step_runtime(ctx: BlockDiagCPContext) -> StepRuntime:
    """The runtime of ``ctx``'s step, shared with its device copies (created on first use)."""
    key = owner(ctx)
    runtime = _RUNTIMES.get(key)
    if runtime is None:
        runtime = _RUNTIMES[key] = StepRuntime()
    return runtime


def find_runtime(ctx: BlockDiagCPContext) -> StepRuntime | None:
    """The runtime of ``ctx``'s step if one was created (never creates one)."""
    return _RUNTIMES.get(owner(ctx))


def plan_key(ctx: BlockDiagCPContext, device: torch.device, window: int | None) -> PlanKey:
    """Where a layer with sliding ``window`` on ``device`` finds its plans (an unplanned window uses the
    full plans, see :meth:`~hf_blockdiag_cp.context.BlockDiagCPContext.plans_for`)."""
    return PlanKey(device, window if window in ctx.window_plans else None)


def device_plan(ctx: BlockDiagCPContext, device: torch.device, window: int | None = None) -> DevicePlan:
    """The varlen plan of a layer with sliding ``window``, on ``device``: copied once per step and device."""
    key = plan_key(ctx, device, window)
    plans = step_runtime(ctx).plans
    found = plans.get(key)
    if found is None:
        plan, _ = ctx.plans_for(key.window)
        found = plans[key] = DevicePlan(plan.to(device))
    return found
