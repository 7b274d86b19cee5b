"""Ending a run's process groups so that a finished job exits 0 (issue 35, item 5).

Why a finished gloo job can die at exit: a gloo worker thread frees each collective's work object once it has run
it. When Python has already dropped the tensors of that work (``dist.all_gather(out, x)`` followed by ``del out``,
a function returning), freeing them takes the GIL. Two things go wrong when that free is still pending:

- a process group freed while the main thread holds the GIL (a ``del``, a function's return, garbage collection:
  ``~ProcessGroupGloo`` joins its worker threads) waits forever on a worker that waits for the GIL (seen on 2- and
  4-rank ``CPTrainer`` runs under load: main thread in ``~Reducer -> ~ProcessGroupGloo -> thread::join``, a
  ``pt_gloo_runloop`` thread in ``~AsyncAllgatherWork -> decref_pyobject -> take_gil``);
- during interpreter shutdown the worker cannot take the GIL at all: Python ends the thread inside a C++ destructor,
  ``terminate called without an active exception`` (SIGABRT), and the launcher fails the whole job.

:func:`close_process_groups` first lets the worker threads finish (the GIL released until every ``pt_gloo_runloop``
thread sleeps), then destroys every process group while the interpreter is fully alive. ``CPTrainer.train``
settles the workers when it returns and registers :func:`close_process_groups` to run at exit (after a run that
ended without an uncaught exception only: destroying groups after a failure can block, as torchtitan notes).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time

import torch.distributed as dist

__all__ = ["close_process_groups", "close_process_groups_at_exit", "settle_collectives"]

logger = logging.getLogger(__name__)

#: The name torch gives gloo's worker threads (``c10::setThreadName`` in ``ProcessGroupGloo::runLoop``).
_GLOO_WORKER = "pt_gloo_runloop"
#: How long one look at the worker threads waits with the GIL released.
_POLL_S = 0.005
#: Consecutive looks at which every worker must sleep before the workers count as idle.
_QUIET_LOOKS = 3

_AT_EXIT: list[bool] = []  # one entry once the exit handler is registered (owner: close_process_groups_at_exit)


def _gloo_workers_busy() -> bool | None:
    """Whether a gloo worker thread of this process is running or runnable (``None``: not observable here)."""
    tasks = "/proc/self/task"
    try:
        tids = os.listdir(tasks)
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                if f.read().strip() != _GLOO_WORKER:
                    continue
            with open(f"{tasks}/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        if state not in ("S", "I"):
            return True
    return False


def settle_collectives(timeout_s: float = 2.0) -> bool:
    """Release the GIL until gloo's worker threads are idle (every one asleep at ``_QUIET_LOOKS`` looks in a row).

    A worker that waits for the GIL to free a finished collective's tensors gets it while this sleeps. Returns
    whether idle workers were observed within ``timeout_s`` (``False`` also where threads cannot be inspected:
    there it waits a fixed ``10 * _POLL_S``). Cheap when nothing is pending: about ``_QUIET_LOOKS * _POLL_S``.
    """
    deadline, quiet = time.monotonic() + timeout_s, 0
    while quiet < _QUIET_LOOKS:
        time.sleep(_POLL_S)
        busy = _gloo_workers_busy()
        if busy is None:
            time.sleep(10 * _POLL_S)
            return False
        quiet = 0 if busy else quiet + 1
        if time.monotonic() > deadline:
            logger.debug("hf_blockdiag_cp: gloo worker threads still busy after %g s", timeout_s)
            return False
    return True


def close_process_groups() -> bool:
    """Settle gloo's worker threads, then destroy every process group (the default one included).

    Call it once, on every rank, after the run's last collective (``CPTrainer`` does it at exit on its own). Local:
    no collective runs, so it cannot wait on a peer. Returns whether there were groups to destroy. Anything that
    still holds a group (a trainer, a batch's context) frees it later without blocking, its workers being idle.
    """
    settle_collectives()
    if not (dist.is_available() and dist.is_initialized()):
        return False
    dist.destroy_process_group()
    return True


def _exiting_on_error() -> bool:
    # Python sets sys.last_value (3.12: also sys.last_exc) when it prints an uncaught exception, before exit handlers.
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _close_at_exit() -> None:
    if _exiting_on_error():
        return
    try:
        close_process_groups()
    except Exception as err:  # at exit nothing is left to fail: say why and let the interpreter end
        logger.warning("hf_blockdiag_cp: destroying the process groups at exit failed: %s", err)


def close_process_groups_at_exit() -> None:
    """Register :func:`close_process_groups` to run when the interpreter exits normally (once per process).

    Exit handlers run while the interpreter is still whole, before it frees what remains; skipped when the program
    ends with an uncaught exception.
    """
    if not _AT_EXIT:
        atexit.register(_close_at_exit)
        _AT_EXIT.append(True)
