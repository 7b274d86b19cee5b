"""The one home of per-step run-time state and of the verbs a step's layers use: agree, backend, exchange, gather,
guard, timeout.

A :class:`~hf_blockdiag_cp.context.BlockDiagCPContext` and its plans are frozen host data. What one step
builds from them lives here, in one :class:`StepRuntime` per context: the plans' device copies with the
kernel schedules derived from them, the CP ranks' agreement, the backend chosen per kernel spec, this
rank's device-ready K/V exchanges and head all-to-alls and the bytes they moved (filled by the first layer, reused by
every later layer and activation-checkpoint recompute), and the number of model forwards run on the context
(counted by the model's pre-hook, :mod:`hf_blockdiag_cp.model.forward_agreement`).

A layer asks the runtime; it does not rebuild the plumbing (every verb takes the step's context, which says the
group, the rank and the configuration):

- :meth:`StepRuntime.agree` — the step's rank agreement, one collective per step whichever token mixer (attention
  or recurrent) comes first, one flag (``agreed_backends``);
- :meth:`StepRuntime.backend` — the kernel backend for a spec (after the agreement), chosen once per step;
- :meth:`StepRuntime.exchange_kv` — this rank's K/V exchange (built once per step, device and planned window), run
  on K and V as one fused buffer;
- :meth:`StepRuntime.head_a2a` — this rank's head all-to-all (head-parallel layouts, built once per device);
- :meth:`StepRuntime.all_gather` — a named, differentiable all-gather of fixed-shape buffers (recurrent state);
- :meth:`StepRuntime.guard` — marks the group broken when a kernel or runner raises between collectives;
- :meth:`StepRuntime.collective_timeout` — the bound on every collective of the step, built once.

This module sits below both :mod:`hf_blockdiag_cp.attention` and :mod:`hf_blockdiag_cp.model`; any token
mixer that runs on a context (attention, recurrent layers) keeps its per-step state here.
:func:`owner` is the one lookup from a context to the context that owns its state (``ctx.origin or ctx``:
``origin`` is the context a device copy was made from); :func:`step_runtime` keys a weak map owned by this
module by that owner, so a context and all its device copies share one runtime, created on first use, and
it goes away with the context. Nothing here references a context, so the weak map never keeps one alive.

Example::

    runtime = step_runtime(ctx)
    runtime.agree(ctx, device)  # once per step: the first mixer runs the collective, the others reuse it
    gathered = runtime.all_gather(ctx, summaries, what="recurrent state all-gather")  # [P * N, W]
    with runtime.guard(ctx, "recurrent gated delta rule runner"):
        out = runner(...)  # a raise here marks the CP group broken (CPKernelError)
"""

from __future__ import annotations

import contextlib
import datetime
import warnings
import weakref
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from .config import BlockDiagCPConfig
from .context import BlockDiagCPContext
from .distributed import CommStats, RankExchange, agree_on_backends, mark_broken
from .distributed.exchange import Deferred, GatherGroup, all_gather, exchange_kv
from .distributed.groups import GroupRef
from .distributed.ulysses import HeadA2A
from .errors import CollectiveError, CPKernelError
from .kernels import KernelSpec, available_backends, backend_names, choose_backend, get_backend
from .kernels._imports import optional_import
from .kernels.base import PlanSchedules
from .planning import VarlenPlan
from .planning.exchange import Strategy
from .planning.fragments import FragmentPlan

__all__ = ["DevicePlan", "PlanKey", "StepRuntime", "abandon", "device_plan", "find_runtime", "installed_backends",
           "owner", "plan_key", "require_live_group", "resolve_backend", "step_runtime"]


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
    """What the layers of one step derive from its context and reuse, and the verbs they run it with.

    Attributes:
        plans: the context's plans on each device, per planned window (:func:`device_plan`).
        agreed_backends: the step's rank agreement, once it ran (the one flag): the backends every CP rank has
            (installed and not disabled); ``None`` before.
        backends: the backend chosen per kernel spec in this step.
        exchanges: this rank's device-ready exchange per device and planned window (``None``: nothing moves).
        comm: bytes moved by this step's K/V exchanges, head all-to-alls and all-gathers.
        media: bytes moved by this step's image / video feature all-to-all (:mod:`hf_blockdiag_cp.model.media`).
        head_a2as: this rank's head all-to-all per device (``ulysses_size > 1`` only).
        forwards: model forwards this rank ran on the context (the forward agreement's counter; a
            gradient-checkpoint recompute runs the layers only and is not counted).
        fragments: the step's :class:`~hf_blockdiag_cp.planning.fragments.FragmentPlan` for recurrent layers
            (CP > 1), planned on first use.
        recurrent: what recurrent layers build once per step and reuse, by a key of their own (owned by
            :mod:`hf_blockdiag_cp.recurrent`: the head-parallel fallback's all-to-alls and row orders per device).
        timeout: the bound on each collective of the step (:meth:`collective_timeout`), built once.
        gather_group: what :meth:`all_gather` runs on (the group, its global ranks, the timeout), built once.
    """

    plans: dict[PlanKey, DevicePlan] = field(default_factory=dict)
    agreed_backends: frozenset[str] | None = None
    backends: dict[KernelSpec, str] = field(default_factory=dict)
    exchanges: dict[PlanKey, RankExchange | None] = field(default_factory=dict)
    comm: CommStats = field(default_factory=CommStats)
    media: CommStats = field(default_factory=CommStats)
    head_a2as: dict[torch.device, HeadA2A] = field(default_factory=dict)
    forwards: int = 0
    fragments: FragmentPlan | None = None
    recurrent: dict[Hashable, object] = field(default_factory=dict)
    timeout: datetime.timedelta | None = None
    gather_group: GatherGroup | None = None

    def collective_timeout(self, ctx: BlockDiagCPContext) -> datetime.timedelta:
        """The bound on each collective of the step (``config.collective_timeout_s``)."""
        if self.timeout is None:
            self.timeout = datetime.timedelta(seconds=ctx.config.collective_timeout_s)
        return self.timeout

    def agree(self, ctx: BlockDiagCPContext, device: torch.device) -> frozenset[str]:
        """The step's rank agreement (``cp_size > 1``): one small collective per step, run by whichever token mixer
        (attention or recurrent) comes first and reused by every other; raises
        :class:`~hf_blockdiag_cp.errors.AgreementError` on every rank alike when the ranks' data, plans or positions
        differ. Returns the backends every rank has installed and not disabled.

        What the ranks compare does not depend on the layer: the spec-dependent part of backend availability
        (device, dtype, head dims, window, dropout) is a pure function of the spec, alike on every rank, and is
        applied per spec by :meth:`backend`.
        """
        if self.agreed_backends is None:
            require_live_group(ctx, ctx.group, "CP")
            self.agreed_backends = agree_on_backends(
                installed_backends(ctx.config.disabled_backends),
                backend_names(),  # the bit order of the availability mask: registration order, alike on every rank
                data_fingerprint=ctx.data_fingerprint, plan_fingerprint=ctx.plan_fingerprint, group=ctx.group,
                rank=ctx.cp_rank, size=ctx.cp_size, timeout=self.collective_timeout(ctx), device=device)
        return self.agreed_backends

    def backend(self, ctx: BlockDiagCPContext, spec: KernelSpec, device: torch.device) -> str:
        """The backend of this step for ``spec``: one every CP rank can run (after :meth:`agree`), chosen once."""
        chosen = self.backends.get(spec)
        if chosen is None:
            agreed = self.agree(ctx, device)
            chosen = self.backends[spec] = resolve_backend(ctx.config, spec, agreed=agreed,
                                                           where=" (on every CP rank)")
        return chosen

    def kv_exchange(self, ctx: BlockDiagCPContext, device: torch.device,
                    window: int | None = None) -> RankExchange | None:
        """This rank's device-ready K/V exchange for layers with ``window`` (``None`` when nothing moves), built
        once per step, device and planned window.

        The exchange plan is over the ``c = cp_size / u`` sequence groups; this rank exchanges with the ranks of
        equal head rank in the other groups (``u == 1``: every CP rank, over ``ctx.group``; ``u > 1``: over
        ``ctx.seq_group``, for this rank's heads only).
        """
        key = plan_key(ctx, device, window)
        if key in self.exchanges:
            return self.exchanges[key]
        _, plan = ctx.plans_for(key.window)
        found = None
        if plan is not None and plan.strategy != Strategy.NONE:
            u = ctx.ulysses_size
            group = ctx.group if u == 1 else ctx.seq_group
            if u > 1:
                require_live_group(ctx, group, "sequence-group")
            seq_rank, head_rank = divmod(ctx.cp_rank, u)
            transfer = plan.for_rank(seq_rank)
            found = RankExchange(
                transfer=transfer, size=plan.cp_size,
                global_ranks=tuple(dist.get_global_rank(ctx.group, g * u + head_rank) for g in range(plan.cp_size)),
                send_index=transfer.send_index.to(device), timeout=self.collective_timeout(ctx), group=group,
                stats=self.comm)
        self.exchanges[key] = found
        return found

    def exchange_kv(self, ctx: BlockDiagCPContext, k_flat: torch.Tensor, v_flat: torch.Tensor,
                    window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Exchange ``k_flat [R, Hkv, D]`` and ``v_flat [R, Hkv, Dv]`` (this rank's rows) as one fused
        ``[R, Hkv * (D + Dv)]`` buffer (one collective forward, one backward: see distributed/exchange.py); returns the
        received + own rows ``[R', Hkv, D / Dv]`` (the inputs when nothing moves for ``window``)."""
        ex = self.kv_exchange(ctx, k_flat.device, window)
        if ex is None:
            return k_flat, v_flat
        rows, num_kv_heads, head_dim = k_flat.shape
        kv = exchange_kv(torch.cat([k_flat.reshape(rows, -1), v_flat.reshape(rows, -1)], dim=1), ex)
        total, split = kv.shape[0], num_kv_heads * head_dim
        return kv[:, :split].view(total, num_kv_heads, head_dim), kv[:, split:].view(total, num_kv_heads, -1)

    def head_a2a(self, ctx: BlockDiagCPContext, device: torch.device) -> HeadA2A:
        """This rank's head all-to-all on ``device`` (``ulysses_size > 1``), built once per step and device."""
        found = self.head_a2as.get(device)
        if found is None:
            require_live_group(ctx, ctx.head_group, "head-parallel")
            found = self.head_a2as[device] = HeadA2A.build(ctx.layout.heads, ctx.cp_rank, ctx.head_group,
                                                           device=device, stats=self.comm,
                                                           timeout=self.collective_timeout(ctx))
        return found

    def all_gather(self, ctx: BlockDiagCPContext, buffer: torch.Tensor, what: str,
                   deferred: Deferred | None = None) -> torch.Tensor:
        """Every CP rank's fixed-shape ``buffer [N, W]`` -> ``[P * N, W]`` (rank ``r``'s rows at ``r * N``),
        differentiable (backward: a reduce-scatter named after it, e.g. ``"recurrent state gradient
        reduce-scatter"``), bounded by the step's timeout, bytes counted in :attr:`comm`.

        Refuses to start (:class:`~hf_blockdiag_cp.errors.CollectiveError` naming ``what``) on a group that failed
        earlier, like every other collective of the package. With ``deferred``
        (:class:`~hf_blockdiag_cp.distributed.exchange.Deferred`) it returns once started: read the result after
        ``deferred.wait()``; the seconds waited there are counted in :attr:`comm` (``waited_s``).
        """
        if self.gather_group is None:
            self.gather_group = GatherGroup(ctx.cp_size, ctx.cp_rank, ctx.group, self.collective_timeout(ctx),
                                            self.comm, _global_ranks(ctx))
        return all_gather(buffer, self.gather_group, what, deferred)

    @contextlib.contextmanager
    def guard(self, ctx: BlockDiagCPContext, what: str) -> Iterator[None]:
        """Run a kernel or runner between collectives: if it raises, record ``ctx.group`` as broken (the peers are
        past this rank's last collective, or stuck in the next one) and raise :class:`CPKernelError` naming ``what``
        (e.g. ``"'sdpa_doc' attention kernel"``). A :class:`CollectiveError` (already recorded, already named)
        passes through unchanged."""
        try:
            yield
        except CollectiveError:
            raise
        except Exception as err:
            raise failure(ctx, what, err) from err


def _global_ranks(ctx: BlockDiagCPContext) -> tuple[int, ...]:
    """The global rank of each rank of ``ctx.group`` (empty for a group torch does not know: the all-gather then
    takes the collective, whose own checks speak for it)."""
    try:
        return tuple(dist.get_global_rank(ctx.group, r) for r in range(ctx.cp_size))
    except (ValueError, RuntimeError):
        return ()


def abandon(ctx: BlockDiagCPContext, err: BaseException) -> None:
    """Record ``ctx.group`` as broken because this rank's forward raised ``err`` after its agreement, between two
    collectives: its peers are in (or on their way to) a collective this rank left. A retry would start the next
    forward's agreement against whatever collective a peer waits in; gloo aborts the process (SIGABRT) when that is an
    all-gather of another size (a K/V all-gather), so the retry must refuse before any collective."""
    mark_broken(ctx.group, f"a forward on CP rank {ctx.cp_rank} raised {type(err).__name__} between its collectives")


def failure(ctx: BlockDiagCPContext, what: str, err: BaseException) -> CPKernelError:
    """Record ``ctx.group`` as broken and build the error for ``what`` (a kernel or runner) that raised ``err``."""
    mark_broken(ctx.group, f"the {what} on CP rank {ctx.cp_rank} failed ({type(err).__name__})")
    return CPKernelError(f"CP rank {ctx.cp_rank}/{ctx.cp_size}: the {what} failed ({type(err).__name__}: {err}); "
                         "peer ranks will stop at their next collective, and this CP group cannot be used again in "
                         "this process (end the job and restart it)")


def installed_backends(disabled: tuple[str, ...] = ()) -> frozenset[str]:
    """The registered backends whose optional library imports in this process, minus the ``disabled`` ones: what
    may differ between ranks (everything else about a backend's availability is a function of the kernel spec)."""
    found = set()
    for name in backend_names():
        caps = get_backend(name).CAPABILITIES
        module = None if caps.module is None else optional_import(caps.module)[0]
        if name in disabled or (caps.module is not None and (module is None or (
                caps.module_attr is not None and not hasattr(module, caps.module_attr)))):
            continue
        found.add(name)
    return frozenset(found)


def resolve_backend(config: BlockDiagCPConfig, spec: KernelSpec, *, agreed: frozenset[str] | None = None,
                    backend: str | None = None, where: str = "") -> str:
    """The backend for ``spec``: the one rule of the public function, the HF entry point and the CP path.

    Args:
        config: ``config.backend`` is the request (environment-overridable) unless ``backend`` is given;
            ``config.disabled_backends`` are never used.
        spec: what the call needs.
        agreed: backends every CP rank can run (the step's rank agreement); ``None`` on one process.
        backend: an explicit request overriding ``config.backend``.
        where: appended to the fallback warning (e.g. that it happened on every CP rank).

    An explicitly requested backend that cannot run falls back to the ``"auto"`` choice with a
    warning; no backend able to compute the call exactly raises ``BackendUnavailable``.
    """
    available = available_backends(spec, config.disabled_backends)
    if agreed is not None:
        available = available & agreed
    name, note = choose_backend(config.backend if backend is None else backend, spec, available)
    if note:
        warnings.warn(f"{note}{where}", stacklevel=3)
    return name


def require_live_group(ctx: BlockDiagCPContext, group: object, name: str) -> None:
    """``group`` (the CP group, or one of its subgroups named ``name``) must be a live process group here
    (pure attribute reads, once per step)."""
    if name == "CP":
        if isinstance(group, GroupRef):
            raise RuntimeError(f"cp_context names the process group {group.name!r}, which this process does not "
                               "have; build the collator in the training process that created the group")
        if group is None or not dist.is_initialized():
            raise RuntimeError("cp_size > 1 needs an initialised torch.distributed process group in "
                               "cp_context.group: build the collator with group=mesh['cp'] (a collator given only "
                               "cp_rank/cp_size builds contexts without one; CPTrainer attaches the mesh's)")
        return
    if group is None or isinstance(group, GroupRef) or not dist.is_initialized():
        raise RuntimeError(f"cp_context (ulysses_size={ctx.ulysses_size}) has no live {name} process group here "
                           f"({group!r}); create the subgroups with hf_blockdiag_cp.ulysses_groups in the training "
                           "process and give them to the collator")


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
