"""Run a function on several real gloo processes, or an example under ``accelerate launch``, with a hard
timeout (a hang must fail the test)."""

from __future__ import annotations

import datetime
import os
import queue
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


ROOT = Path(__file__).resolve().parents[1]
CPU_CP2 = ROOT / "configs" / "accelerate" / "cpu_cp2.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, env: dict,
           pg_timeout_s: float) -> None:
    os.environ.update({k: v for k, v in env.get(rank, {}).items()})
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = fn(rank, world_size, *args)
        results.put((rank, "ok", result))
    except BaseException as err:  # report everything, including assertion errors, to the parent
        results.put((rank, "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0,
              env: dict[int, dict[str, str]] | None = None, pg_timeout_s: float = 60.0,
              expect_failure: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes.

    Returns the per-rank results (``fn`` must return something picklable). Raises ``AssertionError``
    with every failing rank's traceback, or ``TimeoutError`` if the ranks do not finish in
    ``timeout`` seconds (all processes are killed). With ``expect_failure`` returns
    ``[(status, payload) per rank]`` instead of raising on errors.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results, env or {}, pg_timeout_s),
                         daemon=False) for r in range(world_size)]
    for p in procs:
        p.start()
    outcome: dict[int, tuple[str, Any]] = {}
    import time

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
    if expect_failure:
        return [outcome[r] for r in range(world_size)]
    errors = {r: payload for r, (status, payload) in outcome.items() if status != "ok"}
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{msg}" for r, msg in sorted(errors.items())))
    return [outcome[r][1] for r in range(world_size)]


@dataclass(frozen=True)
class Launched:
    """What an example printed (stdout and stderr interleaved) and how it exited."""

    returncode: int
    output: str


def launch_example(script: str, *args: str, launcher_args: tuple[str, ...] = ("--config_file", str(CPU_CP2)),
                   timeout: float = 300, env: dict[str, str] | None = None) -> Launched:
    """``accelerate launch`` of ``examples/<script>`` on a free port, in its own process group so that
    a hang past ``timeout`` kills every rank and fails the test."""
    command = [sys.executable, "-m", "accelerate.commands.launch", *launcher_args, "--main_process_port",
               str(free_port()), str(ROOT / "examples" / script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", **(env or {})}
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{script} did not finish within {timeout:.0f} s:\n{output[-4000:]}") from None
    return Launched(proc.returncode, output)
