"""Fail-fast checks of a training set-up (each error names what to change)."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..data.sharding import resolve_cp
from ..model import prepare_model
from .mesh import cp_coordinates

__all__ = ["accelerate_cp_setting", "check_collator", "check_no_accelerate_cp", "collator_topology", "guard_model"]

#: accelerate's own sequence-sharding settings: (ParallelismConfig field, launcher flag / config key, env var).
_ACCELERATE_SHARDING = (("cp_size", "parallelism_config_cp_size", "PARALLELISM_CONFIG_CP_SIZE"),
                        ("sp_size", "parallelism_config_sp_size", "PARALLELISM_CONFIG_SP_SIZE"))


def guard_model(model: torch.nn.Module) -> torch.nn.Module:
    """``prepare_model(model, strict=True)``: the alias under the name earlier versions documented (model preparation
    has one name, :func:`~hf_blockdiag_cp.model.prepare_model`); prepares ``model`` with the strict checks on
    (idempotent) and returns ``model``.

    Its one pre-forward hook then runs :func:`~hf_blockdiag_cp.model.check_batch` (a ``cp_context`` on a
    model whose attention would ignore it, CP labels without ``shift_labels``) and supplies a batch's
    missing ``position_ids`` from its ``cp_context`` (or raises under CP when the context does not know
    them: :func:`~hf_blockdiag_cp.model.context_position_ids`) before the model-level refusals run; see
    :func:`~hf_blockdiag_cp.model.prepare_model`.
    """
    return prepare_model(model, strict=True)


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
        if coords.cp_size == 1:
            return  # without CP every rank collates whole rows: any collator will do
        raise ValueError(
            f"the data_collator {_name(collator)} does not expose its CP topology (no cp_size/cp_rank attributes, no "
            f"group attribute, no functools.partial group= keyword), so it cannot be checked against the mesh "
            f"(cp_size={coords.cp_size}, cp_rank={coords.cp_rank}): set collate.cp_size = mesh['cp'].size() and "
            "collate.cp_rank = mesh['cp'].get_local_rank() on it, or pass functools.partial(collate, group=mesh['cp'])")
    size, rank, where = topology
    if size != coords.cp_size or rank != coords.cp_rank:
        raise ValueError(f"the data_collator {_name(collator)} shards rows for cp_size={size}, cp_rank={rank} (from "
                         f"{where}) but the mesh has cp_size={coords.cp_size}, cp_rank={coords.cp_rank}; "
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
