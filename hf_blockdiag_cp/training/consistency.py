"""Parameter consistency across a CP group: every rank of a CP group must hold the same weights.

Context parallelism splits one row's tokens over the ranks of a CP group; it is exact only if those ranks
run the same model. Nothing in a step notices when they do not: each rank computes its shard with its own
weights and the gradients are averaged as usual. Ways to get there: data parallelism (DDP) wrapped over
``mesh["dp"]`` only, so the gradients of the CP ranks are never averaged; an ``optimizer.step`` skipped
on one rank (a caught exception, a per-rank NaN check or loss scaler); different seeds at initialisation.

:func:`check_parameters_consistent` compares a fingerprint of every parameter over the CP group. Cost
per check: one pass over the parameters (two float64 reductions each, one float64 temporary of the
largest parameter at a time) and two all-gathers of ``8 + 16 * P`` bytes per rank (``P`` parameters);
for a 1B-parameter model on one GPU about the time of one optimizer step, so ``CPTrainer`` runs it at
the first step and every ``parameter_check_every`` (default 100) steps.
"""

from __future__ import annotations

import datetime
import zlib
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.exchange import all_gather_single, check_usable, wait
from ..distributed.groups import group_timeout
from ..errors import ParameterMismatchError

__all__ = ["ParameterMismatchError", "check_parameters_consistent", "parameter_fingerprints"]

#: Used when torch does not expose the group's own timeout.
_DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)

_CAUSES = ("likely causes: data parallelism (DDP / FSDP) wrapped over mesh['dp'] only instead of the whole mesh, so "
           "the CP ranks' gradients are never averaged; an optimizer.step (or a loss-scaler step) skipped on one rank; "
           "different seeds when the model was initialised (seed every rank the same, e.g. transformers.set_seed, "
           "before building the model)")


def _weights(numel: int, device: torch.device) -> torch.Tensor:
    """A fixed pseudo-random ``[numel]`` float64 weight vector in ``[-0.5, 0.5)`` (the golden-ratio sequence:
    no RNG state, the same on every rank and device)."""
    index = torch.arange(numel, device=device, dtype=torch.float64)
    return torch.remainder(index * 0.6180339887498949, 1.0) - 0.5


def _replicated_local(param: torch.Tensor) -> torch.Tensor | None:
    """The local tensor of ``param`` if it is the same on every rank of a CP group, else ``None``.

    A DTensor sharded along any mesh dimension (FSDP2) holds different shards on the ranks of a CP group
    by design, and the collectives that produce it keep it consistent: it is skipped. A replicated DTensor
    is compared through its local tensor.
    """
    placements = getattr(param, "placements", None)
    if placements is None:
        return param
    if all(type(p).__name__ == "Replicate" for p in placements):
        return param.to_local()
    return None


@torch.no_grad()
def parameter_fingerprints(model: torch.nn.Module) -> tuple[list[str], torch.Tensor]:
    """``(names, fingerprints [P, 2] float64)`` of ``model``'s parameters that are replicated across CP ranks:
    the sum and a weighted sum (fixed pseudo-random weights) of each, in float64. Sharded DTensors are left
    out (see :func:`_replicated_local`)."""
    names, rows = [], []
    for name, param in model.named_parameters():
        local = _replicated_local(param)
        if local is None:
            continue
        flat = local.detach().reshape(-1).to(torch.float64)
        rows.append(torch.stack([flat.sum(), (flat * _weights(flat.numel(), flat.device)).sum()]))
        names.append(name)
    device = next((r.device for r in rows), torch.device("cpu"))
    table = torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64, device=device)
    return names, table


def _group(mesh_or_group: Any) -> Any:
    names = getattr(mesh_or_group, "mesh_dim_names", None)
    if names is not None:
        if "cp" not in names:
            raise ValueError(f"expected a mesh with a 'cp' dimension, got dims {names}")
        return mesh_or_group["cp"].get_group()
    return mesh_or_group


def check_parameters_consistent(model: torch.nn.Module, mesh_or_group: Any, *, step: int,
                                timeout: datetime.timedelta | None = None) -> None:
    """Raise :class:`ParameterMismatchError` on every rank if the ranks of the CP group hold different parameters.

    Args:
        model: the (possibly DDP/FSDP-wrapped) model; every replicated parameter is compared.
        mesh_or_group: a ``("dp", "cp")`` DeviceMesh (its ``cp`` group is used) or the CP process group.
        step: the training step (for the message).
        timeout: bound on each collective (default: the group's own timeout).

    A collective over the CP group: every rank must call it at the same steps. Exact comparison of the
    float64 fingerprints' bits: identical tensors on ranks of the same hardware reduce identically.
    Does nothing without an initialised process group or on a group of one rank.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    group = _group(mesh_or_group)
    size = dist.get_world_size(group)
    if size <= 1:
        return
    rank = dist.get_rank(group)
    what = "parameter consistency check"
    check_usable(group, what, rank)
    timeout = timeout or group_timeout(group) or _DEFAULT_TIMEOUT
    names, table = parameter_fingerprints(model)
    on_cpu = dist.get_backend(group) != "nccl"
    if on_cpu:
        table = table.cpu()
    # First the shape of what follows (count and names), so that ranks with different models do not
    # meet in an all-gather of different sizes.
    header = torch.tensor([len(names), zlib.crc32("\n".join(names).encode())], dtype=torch.int64,
                          device=table.device)
    headers = header.new_empty(size * 2)
    wait(all_gather_single(headers, header, group=group, async_op=True), what, rank, timeout, group=group)
    counts = headers.view(size, 2).tolist()  # the host reads it: once per check, not per step
    if len({tuple(c) for c in counts}) != 1:
        raise ParameterMismatchError(
            f"step {step}: the ranks of the CP group have different parameter sets (count and name hash per rank: "
            f"{counts}); every rank of a CP group must run the same model, wrapped the same way")
    bits = table.contiguous().view(torch.int64).reshape(-1)
    gathered = bits.new_empty(size * bits.numel())
    wait(all_gather_single(gathered, bits, group=group, async_op=True), what, rank, timeout, group=group)
    per_rank = gathered.view(size, len(names), 2)
    differs = (per_rank != per_rank[:1]).any(dim=2).any(dim=0).cpu()
    if bool(differs.any()):
        values = per_rank.view(torch.float64)[:, :, 0].cpu()
        bad = [i for i in range(len(names)) if differs[i]]
        shown = "; ".join(f"{names[i]} (sum per rank: " + ", ".join(f"{float(v):.6g}" for v in values[:, i]) + ")"
                          for i in bad[:3])
        raise ParameterMismatchError(
            f"step {step}: the ranks of the CP group hold different parameters ({len(bad)} of {len(names)} differ: "
            f"{shown}{'; ...' if len(bad) > 3 else ''}); context parallelism is exact only if they hold the same "
            f"weights. {_CAUSES}")
