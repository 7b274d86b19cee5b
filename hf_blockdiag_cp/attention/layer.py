"""What every CP layer path shares, one function per role: check the rows, agree on a backend, exchange K/V,
run the kernel.

The sequence layout (:mod:`.cp`) and the head-parallel layout (:mod:`.ulysses_path`) are each a short
composition of these; a new layout or token mixer (recurrent layers passing state between CP ranks) reuses
them and adds only its own math. Every decision was made on the host when the context was planned
(:meth:`~hf_blockdiag_cp.context.BlockDiagCPContext.build`); these functions only look things up in, or
fill once per step, the step's :class:`~hf_blockdiag_cp.runtime.StepRuntime`:

- :func:`check_local_rows` — the one check that a layer got one packed row of this rank's local tokens;
- :func:`step_backend` — the kernel backend for a spec, after the step's rank agreement (first layer only);
- :func:`kv_exchange` — this rank's device-ready K/V exchange inside its sequence group (the whole CP group
  when ``ulysses_size == 1``), built once per step, device and planned window;
- :func:`exchange_fused_kv` — run that exchange on K and V as one fused buffer;
- :func:`run_kernel` — the kernel on packed rows; a failure marks the CP group broken (:class:`CPKernelError`).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..context import BlockDiagCPContext
from ..distributed import CommStats, RankExchange, agree_on_backends, exchange_kv, mark_broken
from ..distributed.groups import GroupRef
from ..errors import CPKernelError
from ..kernels import KernelSpec, available_backends, backend_names
from ..planning import PlanError
from ..planning.exchange import Strategy
from ..runtime import DevicePlan, plan_key, step_runtime
from .core import attend_flat, check_qkv, resolve_backend

__all__ = ["CPKernelError", "check_local_rows", "comm_stats", "exchange_fused_kv", "kernel_failed", "kv_exchange",
           "require_live_group", "run_kernel", "step_backend", "step_backends"]


def kernel_failed(ctx: BlockDiagCPContext, backend: str, err: BaseException) -> CPKernelError:
    """Record ``ctx.group`` as broken (the peers are past this layer's exchange, or stuck in the next one) and
    build the error for a kernel that raised ``err`` on this rank."""
    failure = f"the {backend!r} attention kernel on CP rank {ctx.cp_rank} failed ({type(err).__name__})"
    mark_broken(ctx.group, failure)
    return CPKernelError(f"CP rank {ctx.cp_rank}/{ctx.cp_size}: the {backend!r} attention kernel failed "
                         f"({type(err).__name__}: {err}); peer ranks will stop at their next collective, and this CP "
                         "group cannot be used again in this process (end the job and restart it)")


def comm_stats(ctx: BlockDiagCPContext) -> CommStats:
    """Bytes this rank moved through K/V exchanges (and head all-to-alls) in this context's step so far."""
    return step_runtime(ctx).comm


def step_backends(ctx: BlockDiagCPContext) -> dict[KernelSpec, str]:
    """Backend chosen per kernel spec in this step (filled as layers run)."""
    return step_runtime(ctx).backends


def collective_timeout(ctx: BlockDiagCPContext) -> datetime.timedelta:
    """The bound on each collective of the step (``config.collective_timeout_s``)."""
    return datetime.timedelta(seconds=ctx.config.collective_timeout_s)


def require_live_group(ctx: BlockDiagCPContext, group: object, name: str) -> None:
    """``group`` (the CP group, or one of its subgroups named ``name``) must be a live process group here
    (pure attribute reads, once per step)."""
    if name == "CP":
        if isinstance(group, GroupRef):
            raise RuntimeError(f"cp_context names the process group {group.name!r}, which this process does not "
                               "have; build the collator in the training process that created the group")
        if group is None or not dist.is_initialized():
            raise RuntimeError("cp_size > 1 needs an initialised torch.distributed process group in "
                               "cp_context.group")
        return
    if group is None or isinstance(group, GroupRef) or not dist.is_initialized():
        raise RuntimeError(f"cp_context (ulysses_size={ctx.ulysses_size}) has no live {name} process group here "
                           f"({group!r}); create the subgroups with hf_blockdiag_cp.ulysses_groups in the training "
                           "process and give them to the collator")


def check_local_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """A CP layer gets one packed row of this rank's local tokens: ``query [1, Hq, L, D]``,
    ``key``/``value`` ``[1, Hkv, L, D / Dv]`` (no KV cache, no appended keys)."""
    check_qkv(query, key, value)
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        raise PlanError(f"CP attention expects one packed row per micro-batch and local keys: got query "
                        f"{tuple(query.shape)}, key {tuple(key.shape)}")


def _agreed_backends(ctx: BlockDiagCPContext, spec: KernelSpec, device: torch.device) -> frozenset[str]:
    """The step's rank agreement (one small collective, first layer only).

    Library/device availability is the same for the later layers; what differs per layer (window,
    dropout) is a pure function of the spec, identical on all ranks.
    """
    runtime = step_runtime(ctx)
    if runtime.agreed_backends is None:
        require_live_group(ctx, ctx.group, "CP")
        config = ctx.config
        runtime.agreed_backends = agree_on_backends(
            available_backends(spec, config.disabled_backends),
            backend_names(),  # the bit order of the availability mask: registration order, alike on every rank
            data_fingerprint=ctx.data_fingerprint,
            plan_fingerprint=ctx.plan_fingerprint,
            group=ctx.group,
            rank=ctx.cp_rank,
            size=ctx.cp_size,
            timeout=collective_timeout(ctx),
            device=device,
        )
    return runtime.agreed_backends


def step_backend(ctx: BlockDiagCPContext, spec: KernelSpec, device: torch.device) -> str:
    """The backend of this step for ``spec``: one every CP rank can run (agreed once per step), chosen once."""
    chosen = step_runtime(ctx).backends
    if spec not in chosen:
        agreed = _agreed_backends(ctx, spec, device)
        chosen[spec] = resolve_backend(ctx.config, spec, agreed=agreed, where=" (on every CP rank)")
    return chosen[spec]


def kv_exchange(ctx: BlockDiagCPContext, device: torch.device, window: int | None = None) -> RankExchange | None:
    """This rank's device-ready K/V exchange for layers with ``window`` (``None`` when nothing moves), built
    once per step, device and planned window.

    The exchange plan is over the ``c = cp_size / u`` sequence groups; this rank exchanges with the ranks of
    equal head rank in the other groups (``u == 1``: every CP rank, over ``ctx.group``; ``u > 1``: over
    ``ctx.seq_group``, for this rank's heads only).
    """
    key = plan_key(ctx, device, window)
    runtime = step_runtime(ctx)
    if key in runtime.exchanges:
        return runtime.exchanges[key]
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
            transfer=transfer,
            size=plan.cp_size,
            global_ranks=tuple(dist.get_global_rank(ctx.group, g * u + head_rank) for g in range(plan.cp_size)),
            send_index=transfer.send_index.to(device),
            timeout=collective_timeout(ctx),
            group=group,
            stats=runtime.comm,
        )
    runtime.exchanges[key] = found
    return found


def exchange_fused_kv(k_flat: torch.Tensor, v_flat: torch.Tensor,
                      ex: RankExchange | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exchange ``k_flat [R, Hkv, D]`` and ``v_flat [R, Hkv, Dv]`` as one fused ``[R, Hkv * (D + Dv)]`` buffer
    (one collective forward, one backward: see distributed/exchange.py); returns the received + own rows
    (``ex is None``: the inputs, nothing moves)."""
    if ex is None:
        return k_flat, v_flat
    rows, num_kv_heads, head_dim = k_flat.shape
    value_dim = v_flat.shape[2]
    kv = exchange_kv(torch.cat([k_flat.reshape(rows, -1), v_flat.reshape(rows, -1)], dim=1), ex)
    total = kv.shape[0]
    return (kv[:, : num_kv_heads * head_dim].view(total, num_kv_heads, head_dim),
            kv[:, num_kv_heads * head_dim:].view(total, num_kv_heads, value_dim))


def run_kernel(ctx: BlockDiagCPContext, q_flat: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
               plan: DevicePlan, backend: str, *, scale: float, dropout_p: float, window: int | None,
               softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """``backend`` on packed ``q_flat [Tq, Hq, D]`` over ``k_flat``/``v_flat [Tk, Hkv, D / Dv]`` with ``plan``
    -> ``[Tq, Hq, Dv]``; a kernel that raises marks the CP group broken and raises :class:`CPKernelError`."""
    try:
        return attend_flat(q_flat, k_flat, v_flat, plan.plan, backend, scale=scale, dropout_p=dropout_p,
                           window=window, softcap=softcap, sinks=sinks, config=ctx.config, schedules=plan.schedules)
    except Exception as err:
        raise kernel_failed(ctx, backend, err) from err
