"""Every forward given a CP context agrees first: one small collective in the model's pre-hook.

The per-step agreement (:mod:`hf_blockdiag_cp.distributed.agreement`, first layer) compares what the
contexts planned; this one compares what each rank's *forward* does with its context, before any layer
runs: how many forwards it ran on that context, grad mode, training mode, gradient checkpointing, the
K/V dtype (parameters and autocast), the attention config, and checksums of the ``input_ids`` /
``position_ids`` the layers will read against the shard the collator fingerprinted (a forward without
``position_ids`` is checked as HF models number it: ``0 .. L-1`` on every rank, wrong for packed rows). Exchange
collectives pair by order, so a rank that runs one extra forward, or a backward that recomputes on one
rank only, would otherwise exchange K/V with the wrong step of its peers.

The forward counter is per context (shared by its device copies) and counts the model forwards, which
run this hook; a gradient-checkpoint recompute runs the layers only, on every rank alike, and is not
counted. A forward counted once on every rank (also a whole-model checkpoint recomputed on every rank)
passes; a forward that runs on some ranks only does not.
"""

from __future__ import annotations

import datetime
import weakref
from typing import Any

import torch
import torch.distributed as dist

from ..context import BlockDiagCPContext
from ..distributed.agreement import FORWARD_TENSORS, agree_on_forward, dtype_code
from ..distributed.groups import GroupRef
from ..planning.fingerprint import shard_checksum
from ..planning.layout import config_values
from ..runtime import find_runtime, step_runtime

__all__ = ["agree_forward", "forward_count"]


#: Per model, its modules that have a ``gradient_checkpointing`` flag (found once: walking every module
#: on every forward costs more than the collective); this module's one cache. The forward counter lives in
#: the step's run-time state (:class:`hf_blockdiag_cp.runtime.StepRuntime`).
_FLAGGED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[torch.nn.Module, ...]] = weakref.WeakKeyDictionary()


def _checkpointing(model: torch.nn.Module) -> bool:
    """Whether some layer of ``model`` has gradient checkpointing on (the flags are read every forward)."""
    flagged = _FLAGGED.get(model)
    if flagged is None:
        flagged = _FLAGGED[model] = tuple(m for m in model.modules() if hasattr(m, "gradient_checkpointing"))
    return any(getattr(m, "gradient_checkpointing", False) is True for m in flagged)


def forward_count(ctx: BlockDiagCPContext) -> int:
    """How many model forwards this rank ran on ``ctx`` (and its device copies)."""
    found = find_runtime(ctx)
    return 0 if found is None else found.forwards


def agree_forward(model: torch.nn.Module, named: dict[str, Any]) -> None:
    """Count this forward on its ``cp_context`` and agree with the CP group about it (``cp_size > 1``).

    Args:
        model: the prepared model whose forward is starting.
        named: the forward's arguments by name (``position_ids`` already filled, if filled).

    A context whose group is not live here is left to the attention layers' own check.
    """
    ctx = named.get("cp_context")
    if not isinstance(ctx, BlockDiagCPContext) or ctx.cp_size <= 1:
        return
    runtime = step_runtime(ctx)
    runtime.forwards += 1
    if ctx.group is None or isinstance(ctx.group, GroupRef) or not dist.is_initialized():
        return
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    device = param.device if param is not None else torch.device("cpu")
    dtype = param.dtype if param is not None else torch.float32
    autocast = torch.is_autocast_enabled(device.type)
    if autocast:
        dtype = torch.get_autocast_dtype(device.type)
    grad = torch.is_grad_enabled()
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    config = get_text() if callable(get_text) else config
    heads = _config_int(config, "num_attention_heads")
    hidden = _config_int(config, "hidden_size")
    fields = {
        "forward": runtime.forwards,
        "grad_enabled": int(grad),
        "training": int(model.training),
        # What HF layers test before recomputing (GradientCheckpointingLayer): flag, training, grad mode.
        "checkpointing": int(model.training and grad and _checkpointing(model)),
        "kv_dtype": dtype_code(dtype),
        "autocast": int(autocast),
        "num_attention_heads": heads,
        "num_key_value_heads": _config_int(config, "num_key_value_heads") or heads,
        "head_dim": _config_int(config, "head_dim") or (hidden // heads if heads else 0),
        "hidden_size": hidden,
    }
    tensors = [named.get(name) for name in FORWARD_TENSORS]
    if tensors[1] is None:  # what HF models then use: every shard numbered from 0
        tensors[1] = torch.arange(ctx.local_len, device=device).expand(ctx.batch_size, -1)
    checksums = [shard_checksum(t) if isinstance(t, torch.Tensor) else -1 for t in tensors]
    expected = ctx.shard_checksums[ctx.cp_rank] if ctx.shard_checksums else (-1,) * len(FORWARD_TENSORS)
    agree_on_forward(fields, checksums, expected, group=ctx.group, rank=ctx.cp_rank, size=ctx.cp_size,
                     timeout=datetime.timedelta(seconds=ctx.config.collective_timeout_s), device=device)


def _config_int(config: object, name: str) -> int:
    """A model config's int attribute as one number for the agreement: the value (0 when unset), or for one set
    per layer (heterogeneous configs) a position-weighted sum of the layers' values, so that ranks whose layers
    differ disagree."""
    values = config_values(config, name)
    if len(values) == 1:
        return int(values[0] or 0)
    return sum((i + 1) * int(v or 0) for i, v in enumerate(values))
