"""Fail-fast checks of a training set-up (each error names what to change)."""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..attention.hf import ATTN_IMPLEMENTATION
from ..context import BlockDiagCPContext
from ..data.sharding import resolve_cp
from .mesh import cp_coordinates, created_cp_size

__all__ = ["accelerate_cp_setting", "check_batch", "check_collator", "check_cp_batch", "check_no_accelerate_cp", "collator_topology",
           "context_position_ids", "guard_model"]

#: accelerate's own sequence-sharding settings: (ParallelismConfig field, launcher flag / config key, env var).
_ACCELERATE_SHARDING = (("cp_size", "parallelism_config_cp_size", "PARALLELISM_CONFIG_CP_SIZE"),
                        ("sp_size", "parallelism_config_sp_size", "PARALLELISM_CONFIG_SP_SIZE"))


def check_batch(model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Raise if a batch with a ``cp_context`` would be silently mis-computed by ``model`` (warn, via
    :func:`check_cp_batch`, when a process with a CP mesh runs a batch without one)."""
    ctx = kwargs.get("cp_context")
    if ctx is None:
        check_cp_batch(kwargs)
        return
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is not None and implementation != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"the batch carries a cp_context but the model's attn_implementation is {implementation!r}: its "
            "attention would ignore the context and attend within each shard only (or across documents). Load it "
            f"with attn_implementation={ATTN_IMPLEMENTATION!r} or call model.set_attn_implementation"
            f"({ATTN_IMPLEMENTATION!r})")
    if getattr(ctx, "cp_size", 1) > 1 and kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise ValueError(
            "a context-parallel batch carries labels but no shift_labels: the model would shift the labels of "
            "each shard locally, which is wrong at every rank boundary; build batches with "
            "hf_blockdiag_cp.PackingCollator (it adds shift_labels computed on the full row)")


def check_cp_batch(kwargs: dict[str, Any]) -> None:
    """Warn (once per process: Python's default warning filter) when a forward without a ``cp_context`` runs on a
    process for which :func:`~hf_blockdiag_cp.init_device_mesh` built a mesh with ``cp_size > 1``.

    Such a batch (e.g. from ``DataCollatorForLanguageModeling`` in a manual loop) is not sharded: every CP rank runs
    all of it, the CP group does the work of one rank ``cp_size`` times over, and nothing fails. ``CPTrainer``
    refuses such a collator; a model guarded by :func:`guard_model` says so here. Forwards that are meant to run
    without CP on such a process (``generate()``, a per-rank evaluation) can ignore the warning.
    """
    if kwargs.get("cp_context") is not None:
        return
    cp_size = created_cp_size()
    if cp_size > 1:
        warnings.warn(
            f"this forward has no cp_context, but hf_blockdiag_cp.init_device_mesh built a mesh with cp_size={cp_size} "
            "on this process: the batch is not sharded, so every CP rank runs all of it. Build training batches with "
            "hf_blockdiag_cp.PackingCollator(seq_len, group=mesh['cp'], ...) (or from_flattened(..., "
            "group=mesh['cp'])); forwards meant to run without CP (generate(), a per-rank evaluation) may ignore this",
            UserWarning, stacklevel=2)


def context_position_ids(ctx: Any, given: Any, like: torch.Tensor | None) -> torch.Tensor | None:
    """The ``position_ids`` a forward with context ``ctx`` must get when it was given ``given``: ``None``
    to keep what it has, else this rank's ``[B, L]`` positions from the context (on ``like``'s device).

    Under CP positions are part of the step: without them the model would number each rank's shard
    from 0, which is wrong on every rank but the first (silently, for RoPE and absolute positions).
    Raises ``ValueError`` when they are missing and the context does not know them, or when the given
    ones do not have the context's local length. Host-side only (shapes, no device reads).
    """
    if not isinstance(ctx, BlockDiagCPContext):
        return None
    if given is not None:
        if isinstance(given, torch.Tensor) and given.shape[-1] != ctx.local_len:
            raise ValueError(f"position_ids has {given.shape[-1]} positions per row but the cp_context plans "
                             f"L={ctx.local_len} local rows; pass the collator's position_ids")
        return None
    positions = ctx.local_position_ids
    if positions is None:
        if ctx.cp_size > 1:
            raise ValueError(
                "a context-parallel batch has no position_ids and its cp_context does not know them: the model "
                f"would number CP rank {ctx.cp_rank}'s rows from 0 instead of by their place in the row; pass the "
                "collator's position_ids (or build the context with BlockDiagCPContext.build(..., position_ids=))")
        return None
    return positions.to(like.device) if like is not None else positions


def _positional_index(model: torch.nn.Module, name: str) -> int | None:
    """Index of parameter ``name`` among ``model.forward``'s positional parameters (``None``: keyword only)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional.index(name) if name in positional else None


def guard_model(model: torch.nn.Module) -> torch.nn.Module:
    """Install the fail-fast checks as a forward pre-hook on ``model`` (idempotent); returns ``model``.

    The hook runs :func:`check_batch`, and supplies a batch's missing ``position_ids`` from its
    ``cp_context`` (or raises under CP when the context does not know them): see
    :func:`context_position_ids`.
    """
    if getattr(model, "_blockdiag_cp_guarded", False):
        return model
    position_arg = _positional_index(model, "position_ids")

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        check_batch(module, kwargs)
        given = kwargs.get("position_ids")
        if given is None and position_arg is not None and len(args) > position_arg:
            given = args[position_arg]
        tensors = [kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args]
        like = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
        positions = context_position_ids(kwargs.get("cp_context"), given, like)
        if positions is None:
            return None
        if position_arg is not None and len(args) > position_arg:  # passed positionally, as None
            return (*args[:position_arg], positions, *args[position_arg + 1:]), kwargs
        return args, {**kwargs, "position_ids": positions}

    model.register_forward_pre_hook(hook, with_kwargs=True)
    model._blockdiag_cp_guarded = True
    return model


def collator_topology(collator: Any) -> tuple[int, int, str] | None:
    """``(cp_size, cp_rank, where)`` a collator exposes, or ``None`` if it exposes none.

    Read from, in order: ``cp_size`` and ``cp_rank`` attributes (a :class:`~hf_blockdiag_cp.PackingCollator`, or a
    function given them), a ``group`` attribute (a CP ``ProcessGroup`` or 1-D ``DeviceMesh``), or the ``group`` /
    ``cp_size`` / ``cp_rank`` keywords of a ``functools.partial``. Raises ``ValueError`` naming the attribute
    that is missing when only one of ``cp_size`` / ``cp_rank`` is set.
    """
    has_size, has_rank = hasattr(collator, "cp_size"), hasattr(collator, "cp_rank")
    if has_size != has_rank:
        missing, present = ("cp_rank", "cp_size") if has_size else ("cp_size", "cp_rank")
        raise ValueError(f"the data_collator {_name(collator)} has a {present} attribute but no {missing}: set both "
                         "(cp_size = mesh['cp'].size(), cp_rank = mesh['cp'].get_local_rank())")
    if has_size:
        return int(collator.cp_size), int(collator.cp_rank), "its cp_size/cp_rank attributes"
    if getattr(collator, "group", None) is not None:
        rank, size, _ = resolve_cp(collator.group, None, None)
        return size, rank, "its group attribute"
    if isinstance(collator, functools.partial):
        keywords = {k: collator.keywords.get(k) for k in ("group", "cp_rank", "cp_size")}
        if any(v is not None for v in keywords.values()):
            rank, size, _ = resolve_cp(keywords["group"], keywords["cp_rank"], keywords["cp_size"])
            return size, rank, "its functools.partial keywords"
    return None


def check_collator(collator: Any, mesh: DeviceMesh | None) -> None:
    """Raise if the collator's CP layout disagrees with the mesh (see :func:`collator_topology`).

    Any callable is accepted when it exposes its topology; under CP (``cp_size > 1``) one that exposes none is
    refused, since nothing would tell a collator that shards for the wrong rank (or not at all) from a right one.
    """
    coords = cp_coordinates(mesh)
    topology = collator_topology(collator)
    if topology is None:
        if coords["cp_size"] == 1:
            return  # without CP every rank collates whole rows: any collator will do
        raise ValueError(
            f"the data_collator {_name(collator)} does not expose its CP topology (no cp_size/cp_rank attributes, no "
            f"group attribute, no functools.partial group= keyword), so it cannot be checked against the mesh "
            f"(cp_size={coords['cp_size']}, cp_rank={coords['cp_rank']}): set collate.cp_size = mesh['cp'].size() and "
            "collate.cp_rank = mesh['cp'].get_local_rank() on it, or pass functools.partial(collate, group=mesh['cp'])")
    size, rank, where = topology
    if size != coords["cp_size"] or rank != coords["cp_rank"]:
        raise ValueError(f"the data_collator {_name(collator)} shards rows for cp_size={size}, cp_rank={rank} (from "
                         f"{where}) but the mesh has cp_size={coords['cp_size']}, cp_rank={coords['cp_rank']}; "
                         "build it with the mesh's CP group (group=mesh['cp'])")


def _name(collator: Any) -> str:
    if isinstance(collator, functools.partial):
        return f"functools.partial({_name(collator.func)}, ...)"
    return getattr(collator, "__qualname__", None) or type(collator).__name__


def accelerate_cp_setting(args: Any = None, accelerator: Any = None) -> str | None:
    """Where accelerate's own context (or sequence) parallelism is switched on, as the setting's name and value, or
    ``None``.

    Looked up in ``args.parallelism_config`` (``TrainingArguments``), ``accelerator.parallelism_config``, the
    ``PARALLELISM_CONFIG_CP_SIZE`` / ``_SP_SIZE`` environment that ``accelerate launch`` sets from a config file's
    ``parallelism_config``, and, on Linux, the launcher's own command line: ``accelerate launch
    --parallelism_config_cp_size N`` without ``--use_parallelism_config`` is dropped by the launcher without a
    word, so the parent process's arguments are the only trace of it.
    """
    for where, config in (("TrainingArguments.parallelism_config", getattr(args, "parallelism_config", None)),
                          ("accelerator.parallelism_config", getattr(accelerator, "parallelism_config", None))):
        for field, _, _ in _ACCELERATE_SHARDING:
            value = getattr(config, field, None) if config is not None else None
            if isinstance(value, int) and value > 1:
                return f"{where}.{field}={value}"
    for _, key, env in _ACCELERATE_SHARDING:
        value = os.environ.get(env, "").strip()
        if value.isdigit() and int(value) > 1:
            return f"{env}={value} (set by accelerate launch from the config file's parallelism_config.{key})"
    return _launcher_flag(os.getppid())


def _launcher_flag(pid: int) -> str | None:
    """``--parallelism_config_{cp,sp}_size N`` (N > 1) on the command line of process ``pid`` if it is
    ``accelerate launch``; ``None`` otherwise or where ``/proc`` cannot be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = [a.decode(errors="replace") for a in fh.read().split(b"\0") if a]
    except OSError:
        return None
    if not any("accelerate" in a for a in argv[:3]):
        return None
    return _flag_in(argv)


def _flag_in(argv: Sequence[str]) -> str | None:
    for i, token in enumerate(argv):
        for _, key, _ in _ACCELERATE_SHARDING:
            for spelling in (f"--{key}", f"--{key.replace('_', '-')}"):
                value = None
                if token == spelling and i + 1 < len(argv):
                    value = argv[i + 1]
                elif token.startswith(spelling + "="):
                    value = token[len(spelling) + 1:]
                if value is not None and value.strip().isdigit() and int(value) > 1:
                    return f"{spelling} {value} on the accelerate launch command line"
    return None


def check_no_accelerate_cp(args: Any = None, accelerator: Any = None) -> None:
    """Raise ``ValueError`` if accelerate's own context/sequence parallelism is set (see :func:`accelerate_cp_setting`).

    accelerate's CP is torch ring attention with a forced ``is_causal=True`` (packed documents attend to each other),
    needs FSDP2 on GPUs, and would shard the sequence a second time under this package's CP.
    """
    setting = accelerate_cp_setting(args, accelerator)
    if setting is not None:
        raise ValueError(
            f"{setting}: accelerate's own context parallelism cannot be combined with hf_blockdiag_cp (it is ring "
            "attention with a forced causal mask, so packed documents would attend to each other, and the rows would "
            "be sharded twice). Remove it and set this package's cp_size instead: "
            "hf_blockdiag_cp.init_device_mesh(cp_size=...), or --cp-size in the examples")
