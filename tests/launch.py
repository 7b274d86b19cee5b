"""Run a function on several real gloo processes, or an example under ``accelerate launch``, with a hard
timeout (a hang must fail the test).

The rendezvous cannot race: the process that starts the ranks owns their store and outlives them. Nothing
picks a free port and hands it to a child to bind (another process may take it in between), and no rank
serves the store (rank 0 leaving early would reset its peers' connections)."""

from __future__ import annotations

import datetime
import os
import queue
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
CPU_CP2 = ROOT / "configs" / "accelerate" / "cpu_cp2.yaml"
LOCALHOST = "127.0.0.1"
#: How often :func:`run_ranks` starts a rank set whose group creation failed.
STARTUP_ATTEMPTS = 3
STARTUP_FAILED = "startup-failed"
#: What a failed group creation prints (an example run by :func:`run_example` creates its group itself).
STARTUP_CAUSES = ("connectFullMesh failed",)


@contextmanager
def hosted_stores(count: int = 1) -> Iterator[list[int]]:
    """``count`` TCPStore servers hosted by this (the parent) process, yielding their ports.

    The OS picks each port while the server binds it (port 0), so no other process can take it between
    choosing and binding, and the servers live until the ``with`` block ends, i.e. after every rank has
    exited: ranks connect as clients and no rank leaving early can take the rendezvous down with it.
    A process group made on a store leaves keys behind, so each fresh default group needs its own store.
    """
    import torch.distributed as dist

    stores = [dist.TCPStore(LOCALHOST, 0, is_master=True, wait_for_workers=False) for _ in range(count)]
    try:
        yield [store.port for store in stores]
    finally:
        del stores  # the servers stop here, once no rank needs them


def client_env(port: int) -> dict[str, str]:
    """The environment under which ``init_process_group(init_method="env://")`` (what ``torchrun``,
    ``accelerate`` and ``hf_blockdiag_cp.init_device_mesh`` use) connects to the store on ``port`` as a
    client instead of rank 0 serving it (torchrun sets the same variable when its agent hosts the store)."""
    return {"MASTER_ADDR": LOCALHOST, "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def _rank_context() -> Any:
    """The fork server every rank starts from (one per test process, started on first use): it imports
    what the ranks need once (:mod:`tests._rank_preload`), and each rank is forked from it, unpickling its
    arguments as a spawned process would, with a single thread and no state of the test process."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["tests._rank_preload"])
    return ctx


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, env: dict,
           pg_timeout_s: float, parent_env: dict[str, str]) -> None:
    # The fork server's environment is the test process's when it started: take the one of now, as a spawn would.
    os.environ.clear()
    os.environ.update(parent_env)
    rank_env = env.get(rank, {})
    os.environ.update({k: v for k, v in rank_env.items() if not k.startswith("_")})
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        if rank_env.get("_INIT_GROUP", "1") == "1":
            try:
                if rank_env.get("_FAIL_STARTUP_ON_ATTEMPT") == rank_env.get("_ATTEMPT"):  # the launcher's own test
                    raise RuntimeError("Gloo connectFullMesh failed (injected by the test of the retry)")
                # The parent serves the store; each attempt of the rank set has its own prefix on it.
                store = dist.PrefixStore(rank_env.get("_ATTEMPT", "0"),
                                         dist.TCPStore(LOCALHOST, port, is_master=False, timeout=timeout))
                dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
            except Exception as err:  # a start-up failure (e.g. gloo's connectFullMesh on a busy machine): retried
                results.put((rank, STARTUP_FAILED, f"{type(err).__name__}: {err}"))
                raise SystemExit(1) from None
        else:  # the function creates the group itself (env://, as under a launcher): the parent's store
            os.environ.update(client_env(port))
            os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                               "LOCAL_WORLD_SIZE": str(world_size)})
        result = fn(rank, world_size, *args)
        results.put((rank, "ok", result))
    except BaseException as err:  # report everything, including assertion errors, to the parent
        results.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            from hf_blockdiag_cp.training import close_process_groups

            try:  # gloo's workers settled first: a group still referenced and freed at shutdown would abort the rank
                close_process_groups()
            except Exception:
                pass


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0,
              env: dict[int, dict[str, str]] | None = None, pg_timeout_s: float = 60.0,
              expect_failure: bool = False, init_group: bool = True) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes.

    The default process group's store is served by this process (:func:`hosted_stores`) until every rank
    has exited. Returns the per-rank results (``fn`` must return something picklable). Raises
    ``AssertionError`` with every failing rank's traceback, or ``TimeoutError`` if the ranks do not finish
    in ``timeout`` seconds (all processes are killed). With ``expect_failure`` returns
    ``[(status, payload) per rank]`` instead of raising on errors.

    Start-up is retried: when a rank fails to create the group (on a busy machine gloo's ``connectFullMesh``
    can fail with "Connection closed by peer"), every rank of the set is stopped at once (none waits out its
    timeout) and the whole set starts again on a fresh store, up to ``STARTUP_ATTEMPTS`` times, the cause
    printed to stderr. ``init_group=False``: ``fn`` creates the default group itself from the launcher's
    environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of this process's store), as a script
    run by ``torchrun`` does; it is not retried.
    """
    env = dict(env or {})
    for attempt in range(STARTUP_ATTEMPTS):
        attempt_env = {r: {**env.get(r, {}), "_ATTEMPT": str(attempt), "_INIT_GROUP": "1" if init_group else "0"}
                       for r in range(world_size)}
        with hosted_stores(1) as (port,):
            outcome = _spawn_and_collect(fn, world_size, args, port, timeout, attempt_env, pg_timeout_s,
                                         stop_on=STARTUP_FAILED)
        failed = {r: payload for r, (status, payload) in outcome.items() if status == STARTUP_FAILED}
        if not failed:
            break
        print(f"tests.launch: attempt {attempt + 1}/{STARTUP_ATTEMPTS} of {getattr(fn, '__name__', fn)} on "
              f"{world_size} ranks failed to start: {failed}; retrying on a fresh store", file=sys.stderr)
    else:
        raise AssertionError(f"{world_size} ranks failed to create their process group {STARTUP_ATTEMPTS} times: "
                             f"{failed}")
    if expect_failure:
        return [outcome[r] for r in range(world_size)]
    errors = {r: payload for r, (status, payload) in outcome.items() if status != "ok"}
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(errors.items())))
    return [outcome[r][1] for r in range(world_size)]


def _spawn_and_collect(fn: Callable, world_size: int, args: tuple, port: int, timeout: float, env: dict,
                       pg_timeout_s: float, entry: Callable = _entry, stop_on_failure: bool = False,
                       stop_on: str | None = None) -> dict[int, tuple[str, Any]]:
    """Start the ranks (``entry`` in each), gather ``{rank: (status, payload)}``, and return only once every
    rank has exited. ``stop_on_failure``: as torchrun does, the first rank to fail (an error, or a non-zero
    exit status as its payload) has the others terminated (SIGTERM). ``stop_on``: a status that has the others
    terminated (their status is then ``stop_on`` too)."""
    ctx = _rank_context()
    results = ctx.Queue()
    parent_env = dict(os.environ)
    procs = [ctx.Process(target=entry, args=(r, world_size, port, fn, args, results, env, pg_timeout_s, parent_env),
                         daemon=False) for r in range(world_size)]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(outcome))} did not finish within "
                                   f"{timeout:.0f} s (finished: {outcome})")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
                outcome[rank] = (status, payload)
                if stop_on is not None and status == stop_on:
                    for other, p in enumerate(procs):
                        if other not in outcome:
                            p.kill()
                            outcome[other] = (stop_on, "stopped: a peer failed to start")
                    break
                if stop_on_failure and (status != "ok" or payload):
                    for other, p in enumerate(procs):
                        if other not in outcome and p.is_alive():
                            p.terminate()
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcome and p.exitcode]
                if dead and all(not p.is_alive() for p in procs):
                    # Drain late messages, then report ranks that died without a word (e.g. killed).
                    while True:
                        try:
                            rank, status, payload = results.get(timeout=1.0)
                            outcome[rank] = (status, payload)
                        except queue.Empty:
                            break
                    for r in range(world_size):
                        outcome.setdefault(r, ("error", f"rank {r} exited with code {procs[r].exitcode}"))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return outcome


@dataclass(frozen=True)
class Launched:
    """What an example printed (stdout and stderr interleaved) and how it exited."""

    returncode: int
    output: str


def launch_example(script: str, *args: str, launcher_args: tuple[str, ...] = ("--config_file", str(CPU_CP2)),
                   timeout: float = 300, env: dict[str, str] | None = None) -> Launched:
    """``accelerate launch`` of ``examples/<script>``, in its own process group so that a hang past
    ``timeout`` kills every rank and fails the test.

    No port is picked here: ``PET_STANDALONE=1`` (torchrun's ``--standalone``, which accelerate's launcher
    reads from the environment) turns the config's static rendezvous into torchrun's single-node one, where
    the launcher process -- the ranks' parent, which outlives them -- binds an OS-chosen port (``localhost:0``)
    for the rendezvous store and serves the ranks' store, the ranks connecting as clients
    (``TORCHELASTIC_USE_AGENT_STORE=True``)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", *launcher_args, str(ROOT / "examples" / script),
               *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "PET_STANDALONE": "1", **(env or {})}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{script} did not finish within {timeout:.0f} s:\n{output[-4000:]}") from None
    return Launched(proc.returncode, output)


def _example_entry(rank: int, world_size: int, port: int, script: str, argv: tuple, results, env: dict,
                   pg_timeout_s: float, parent_env: dict[str, str]) -> None:
    """One rank of :func:`run_example`: the example as ``python examples/<script>`` under a launcher would run
    it, its stdout and stderr (file descriptors 1 and 2, so C-level output too) in ``env["_LOG_DIR"]``."""
    import runpy

    log_dir = env["_LOG_DIR"]
    os.environ.clear()
    os.environ.update(parent_env)
    os.environ.update({  # what torchrun gives a worker (its agent serving the store) and accelerate launch adds
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size), "ROLE_WORLD_SIZE": str(world_size),
        "TORCHELASTIC_RESTART_COUNT": "0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
        "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "ACCELERATE_MIXED_PRECISION": "no",
        "ACCELERATE_DYNAMO_BACKEND": "NO", **client_env(port)})
    os.environ.update({k: v for k, v in env.items() if not k.startswith("_")})
    log = os.open(os.path.join(log_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    path = script if os.path.isabs(script) else str(ROOT / "examples" / script)
    os.chdir(ROOT)
    sys.path.insert(0, os.path.dirname(path))  # as for ``python path``: the example imports its ``common``
    sys.argv = [path, *argv]
    code: int = 0
    try:
        import torch

        torch.set_num_threads(1)
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exit_:  # what the interpreter would do with it
        if isinstance(exit_.code, str):
            print(exit_.code, file=sys.stderr)
        code = exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    results.put((rank, "ok", code))
    results.close()
    results.join_thread()  # the result is written before the process ends
    os._exit(code)  # like an interpreter exit, without running the fork server's atexit handlers


def run_example(script: str, *args: str, world_size: int = 2, timeout: float = 300,
                env: dict[str, str] | None = None) -> Launched:
    """``examples/<script>`` on ``world_size`` ranks forked from the preloaded fork server, as ``accelerate
    launch --config_file configs/accelerate/cpu_cp2.yaml`` starts it (the environment torchrun gives its
    workers, the ranks connecting to a store this process serves), without each rank importing torch,
    transformers and the package again (~10 s of a launch on 2 cores). :func:`launch_example` remains the
    test of the launcher itself. As under torchrun, the first rank to fail has the others terminated.
    ``output``: rank 0's stdout and stderr, then the other ranks' in order; ``returncode``: the first non-zero
    exit status of a rank (0 when all succeed)."""
    import tempfile

    for attempt in range(STARTUP_ATTEMPTS):
        with tempfile.TemporaryDirectory() as log_dir, hosted_stores(1) as (port,):
            outcome = _spawn_and_collect(script, world_size, args, port, timeout,
                                         {**(env or {}), "_LOG_DIR": log_dir}, 60.0, entry=_example_entry,
                                         stop_on_failure=True)
            output = "".join(Path(log_dir, f"rank{r}.log").read_text(errors="replace")
                             if Path(log_dir, f"rank{r}.log").exists() else "" for r in range(world_size))
        codes = [payload if status == "ok" else 1 for status, payload in (outcome[r] for r in range(world_size))]
        code = next((c for c in codes if c), 0)
        # The example creates its group itself (env://): a start-up failure shows as gloo's message in its output.
        if not code or not any(cause in output for cause in STARTUP_CAUSES):
            break
        print(f"tests.launch: attempt {attempt + 1}/{STARTUP_ATTEMPTS} of {script} failed to start its process group; "
              "retrying on a fresh store", file=sys.stderr)
    return Launched(code, output)
