"""Every forward given a CP context agrees first: one small collective in the model's pre-hook.

The per-step agreement (:mod:`hf_blockdiag_cp.distributed.agreement`, first layer) compares what the
contexts planned; this one compares what each rank's *forward* does with its context, before any layer
runs: how many forwards it ran on that context, grad mode, training mode, gradient checkpointing, the
K/V dtype (parameters and autocast), the attention config, the recurrent kernel request (and the kernel libraries
it resolves against), and checksums of the ``input_ids`` /
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
from ..distributed.agreement import agree_on_values
from ..distributed.groups import GroupRef
from ..planning.fingerprint import shard_checksum
from ..recurrent.backend import agreement_code, describe_code
from ..runtime import find_runtime, step_runtime
from .heads import config_int, text_config

__all__ = ["FORWARD_FIELDS", "FORWARD_TENSORS", "agree_forward", "agree_on_forward", "dtype_code", "forward_count"]


#: What every CP rank's forward must do alike, in the order the forward agreement exchanges it, with the
#: likely cause of a difference.
FORWARD_FIELDS: dict[str, str] = {
    "forward": "the count of forwards run on this cp_context differs: a rank ran an extra forward (a debug or "
               "evaluation forward, a manual recompute) or skipped one, or re-used the cp_context of an earlier "
               "step; every forward on a context must run on every CP rank, and each step needs the context its "
               "collator built",
    "grad_enabled": "torch.no_grad() / inference_mode() is active on some ranks only",
    "training": "model.train() / model.eval() differs between the ranks",
    "checkpointing": "gradient checkpointing is on for some ranks only (their backward would recompute and "
                     "exchange K/V again); enable it on every rank or on none",
    "kv_dtype": "the K/V dtype differs (autocast on some ranks only, or models loaded in different dtypes): "
                "K/V rows of different dtypes cannot be exchanged",
    "autocast": "autocast is enabled on some ranks only",
    "num_attention_heads": "the ranks' model configs differ",
    "num_key_value_heads": "the ranks' model configs differ",
    "head_dim": "the ranks' model configs differ",
    "hidden_size": "the ranks' model configs differ",
    "recurrent_backend": "the ranks ask for different recurrent kernels (BlockDiagCPConfig.recurrent_backend or "
                         "HF_BLOCKDIAG_CP_RECURRENT_BACKEND differs) or can import different kernel libraries "
                         "(flash-linear-attention, mamba_ssm, causal-conv1d); every rank must run the same "
                         "recurrent path",
}
#: The checked batch tensors, in row order (their expected checksums, then the forward's).
FORWARD_TENSORS: tuple[str, ...] = ("input_ids", "position_ids")
#: First entry of every forward agreement row: a row that lacks it was paired with another collective.
_FORWARD_MAGIC = 0x6264_6370_6677  # "bdcpfw"
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def dtype_code(dtype: torch.dtype) -> int:
    """``dtype`` as a small int every rank encodes alike (for the forward agreement)."""
    return DTYPES.index(dtype) if dtype in DTYPES else 100 + len(str(dtype))


def _describe(name: str, value: int) -> str:
    if name == "kv_dtype":
        return str(DTYPES[value]).removeprefix("torch.") if 0 <= value < len(DTYPES) else f"dtype code {value}"
    if name == "recurrent_backend":
        return describe_code(value)
    if name in ("grad_enabled", "training", "checkpointing", "autocast"):
        return "on" if value else "off"
    return str(value)


def _tensor_hint(name: str) -> str:
    positions = ("per-shard positions, no position_ids so that the model numbers the shard from 0 "
                 "(guard_model supplies them), " if name == "position_ids" else "")
    return (f"the forward's {name} are not the shard the context was built for ({name} edited after collation, "
            f"{positions}or another batch's cp_context)")


#: The checked tensors with the message for a mismatch.
_CHECKED: dict[str, str] = {name: _tensor_hint(name) for name in FORWARD_TENSORS}
#: Why a peer may never join the agreement (or join with another collective's message).
_ON_TIMEOUT = f"the ranks ran different forwards: {FORWARD_FIELDS['forward']}"


def agree_on_forward(fields: dict[str, int], checksums: list[torch.Tensor | int], expected: tuple[int, ...], *,
                     group: Any, rank: int, size: int, timeout: datetime.timedelta, device: torch.device) -> None:
    """One small collective before a forward's first K/V exchange; raises
    :class:`~hf_blockdiag_cp.distributed.AgreementError` on every rank alike when the ranks' forwards differ.

    Args:
        fields: this forward's :data:`FORWARD_FIELDS` (all of them, as ints).
        checksums: per :data:`FORWARD_TENSORS`, the checksum of the tensor this forward received (a 0-d
            int64 tensor on its device, or ``-1``: not given).
        expected: per :data:`FORWARD_TENSORS`, what this rank's context says it must receive (``-1``: unknown).
        group / rank / size / timeout / device: the CP group, this rank's place in it, the bound, the device.
    """
    agree_on_values(fields, checksums, expected, causes=FORWARD_FIELDS, checked=_CHECKED, describe=_describe,
                    what="blockdiag_cp forward agreement", subject="this forward", on_timeout=_ON_TIMEOUT,
                    tag=_FORWARD_MAGIC, group=group, rank=rank, size=size, timeout=timeout, device=device)


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
    config = text_config(getattr(model, "config", None))
    heads = config_int(config, "num_attention_heads")
    hidden = config_int(config, "hidden_size")
    fields = {
        "forward": runtime.forwards,
        "grad_enabled": int(grad),
        "training": int(model.training),
        # What HF layers test before recomputing (GradientCheckpointingLayer): flag, training, grad mode.
        "checkpointing": int(model.training and grad and _checkpointing(model)),
        "kv_dtype": dtype_code(dtype),
        "autocast": int(autocast),
        "num_attention_heads": heads,
        "num_key_value_heads": config_int(config, "num_key_value_heads") or heads,
        "head_dim": config_int(config, "head_dim") or (hidden // heads if heads else 0),
        "hidden_size": hidden,
        "recurrent_backend": agreement_code(ctx.config.recurrent_backend, device),
    }
    tensors = [named.get(name) for name in FORWARD_TENSORS]
    if tensors[1] is None:  # what HF models then use: every shard numbered from 0
        tensors[1] = torch.arange(ctx.local_len, device=device).expand(ctx.batch_size, -1)
    checksums = [shard_checksum(t) if isinstance(t, torch.Tensor) else -1 for t in tensors]
    expected = ctx.shard_checksum or (-1,) * len(FORWARD_TENSORS)
    agree_on_forward(fields, checksums, expected, group=ctx.group, rank=ctx.cp_rank, size=ctx.cp_size,
                     timeout=runtime.collective_timeout(ctx), device=device)
