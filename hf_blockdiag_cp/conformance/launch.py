"""The check's context-parallel runs: :func:`spawn_ranks` runs a rank function on spawned gloo ranks; :func:`run_cp`
is the ``collator`` variant on ``cp_size`` of them (image-text-to-text rows: :mod:`.vlm_runs`).

The parent process owns the rendezvous (a ``TCPStore`` it binds on a port the OS picks, and keeps until
every rank has finished), so no port can be taken between choosing it and binding it. Each rank of :func:`run_cp`
builds the same seeded model, runs its shard of a :class:`PackingCollator` batch, all-reduces the gradients and
all-gathers its logits with the positions they belong to (``cp_context.local_index``, any placement)."""

from __future__ import annotations

import contextlib
import datetime
import os
import queue as queue_module
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import Refusal
from ..training.shutdown import close_process_groups
from .result import describe_error, is_refusal
from .runs import build_model, collated_batch, forward_logits

__all__ = ["CP_TIMEOUT_S", "run_cp", "spawn_ranks"]

#: Seconds the parent waits for all ranks of one CP run.
CP_TIMEOUT_S = 600.0
_HOST = "127.0.0.1"


#: Starts of the rank set when a rank fails to create the process group (gloo's ``connectFullMesh`` can fail
#: with "Connection closed by peer" on a machine busy with other gloo jobs).
STARTUP_ATTEMPTS = 3


def spawn_ranks(target: Callable[..., Any], args: tuple[Any, ...], world: int) -> list[Any]:
    """``target(rank, world, *args)`` on ``world`` spawned gloo ranks, the default process group created before it
    runs and destroyed after it: the ranks' return values, in rank order (send numpy arrays or plain data, not
    tensors: a tensor goes through shared memory that the rank frees on exit). ``target`` is a module-level function.
    A refusal on any rank is re-raised as :class:`~hf_blockdiag_cp.errors.Refusal` (a ``NotImplementedError``), any
    other error as ``RuntimeError`` (both with the rank's message); ranks that do not all finish within
    :data:`CP_TIMEOUT_S` raise ``TimeoutError``.

    A rank that fails to create the process group has the others stopped at once (none waits out
    :data:`CP_TIMEOUT_S`), and the whole set starts again on a fresh store, up to :data:`STARTUP_ATTEMPTS` times."""
    for attempt in range(STARTUP_ATTEMPTS):
        outcome = _run_once(target, args, world)
        startup = [payload[2] for payload in outcome.values() if payload[0] == "startup"]
        if not startup:
            break
        print(f"hf_blockdiag_cp.conformance: CP ranks failed to start (attempt {attempt + 1}/{STARTUP_ATTEMPTS}): "
              f"{startup[0]}", file=sys.stderr)
    else:
        raise RuntimeError(f"CP ranks failed to create their process group {STARTUP_ATTEMPTS} times: {startup[0]}")
    errors = [payload for payload in outcome.values() if payload[0] == "error"]
    if errors:
        kind, message = errors[0][1], errors[0][2]
        raise (Refusal if kind == "refused" else RuntimeError)(message)
    return [outcome[rank][1] for rank in range(world)]


def run_cp(config: Any, docs: Sequence[torch.Tensor], cp_size: int, seed: int, pad: int, *, ulysses_size: int = 1
           ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The collator path on ``cp_size`` gloo ranks (:func:`spawn_ranks`): ``(logits of the real tokens [T, V],
    gradients)`` (logits all-gathered, gradients all-reduced over the ranks). A refusal on any rank is re-raised
    as ``NotImplementedError``, any other error as ``RuntimeError`` (both with the rank's message).

    ``ulysses_size > 1``: the head-parallel layout over that many of the ranks (subgroups made in the ranks)."""
    payload = spawn_ranks(_cp_rank, (config, [d.tolist() for d in docs], seed, pad, ulysses_size), cp_size)[0]
    grads = {name: torch.from_numpy(g) for name, g in payload["grads"].items()}
    return torch.from_numpy(payload["logits"]), grads


def _run_once(target: Callable[..., Any], args: tuple[Any, ...], world: int) -> dict[int, tuple[Any, ...]]:
    """One start of the rank set: ``{rank: ("ok", value) | ("error", kind, message) | ("startup", ...)}`` (a
    start-up failure stops the others at once)."""
    store = dist.TCPStore(_HOST, 0, world_size=world + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=CP_TIMEOUT_S))
    ctx = _rank_context()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, store.port, queue, target, args)) for r in range(world)]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[Any, ...]] = {}
    deadline = time.monotonic() + CP_TIMEOUT_S
    try:
        while len(outcome) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"CP ranks did not finish within {CP_TIMEOUT_S:.0f} s (finished: {sorted(outcome)})")
            try:
                rank, payload = queue.get(timeout=min(remaining, 1.0))
                outcome[rank] = payload
                if payload[0] == "startup":
                    for other, p in enumerate(procs):
                        if other not in outcome:
                            p.kill()
                            outcome[other] = ("startup", "error", "stopped: a peer failed to start")
            except queue_module.Empty:
                if all(not p.is_alive() for p in procs) and len(outcome) < world:
                    raise RuntimeError(f"CP ranks exited without a result (codes {[p.exitcode for p in procs]})")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        del store  # only now: every rank has finished with the rendezvous
    return outcome


def _rank_context() -> Any:
    """Ranks are forked from a server that imported this module (torch, transformers, the package) once, each
    unpickling its arguments as a spawned process would: a CP run then starts in about a second instead of
    every rank re-importing everything (the tests and ``--cp2-sample`` run many in one process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # no effect once this process's fork server runs: it has torch too
    return ctx


def _rank_main(rank: int, world: int, port: int, queue: Any, target: Callable[..., Any], args: tuple[Any, ...]
               ) -> None:
    """One rank: join the group on the parent's store, run ``target``, put its value (or its error) on ``queue``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(_HOST, port, is_master=False, timeout=datetime.timedelta(seconds=CP_TIMEOUT_S))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=CP_TIMEOUT_S))
    except Exception as err:  # retried by spawn_ranks with a fresh store
        queue.put((rank, ("startup", "error", describe_error(err))))
        return
    try:
        queue.put((rank, ("ok", target(rank, world, *args))))
    except Exception as err:
        queue.put((rank, ("error", "refused" if is_refusal(err) else "error", describe_error(err))))
    finally:
        if dist.is_initialized():
            # gloo's workers settled first: a group still referenced and freed at shutdown would abort the rank
            with contextlib.suppress(Exception):
                close_process_groups()


def _cp_rank(rank: int, world: int, config: Any, docs: list[list[int]], seed: int, pad: int, ulysses_size: int = 1
             ) -> dict[str, Any] | None:
    """One rank of :func:`run_cp`: its shard forward and backward; rank 0 returns the row's logits and the summed
    gradients."""
    model = build_model(config, "blockdiag_cp", seed)
    tensors = [torch.tensor(d) for d in docs]
    batch = collated_batch(tensors, cp_size=world, cp_rank=rank, group=dist.group.WORLD, pad_token_id=pad,
                           ulysses_size=ulysses_size, model_config=config)
    shift = batch.pop("_shift_labels")[0]
    local_index = batch["cp_context"].local_index  # this rank's positions in the row (any placement)
    logits = forward_logits(model, **batch)[0]
    torch.nn.functional.cross_entropy(logits.float(), shift, ignore_index=-100, reduction="sum").backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        grads[name] = g
    gathered = [torch.empty_like(logits) for _ in range(world)]
    dist.all_gather(gathered, logits.detach().contiguous())
    where = [torch.empty_like(local_index) for _ in range(world)]
    dist.all_gather(where, local_index)
    full = torch.empty(world * logits.shape[0], logits.shape[1], dtype=logits.dtype)
    full[torch.cat(where)] = torch.cat(gathered)
    total = sum(len(d) for d in docs)
    full = full[:total].float()
    if rank != 0:
        return None
    return {"logits": full.numpy(), "grads": {n: g.detach().numpy() for n, g in grads.items()}}
