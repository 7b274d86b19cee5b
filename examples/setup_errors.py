"""How the examples end on a set-up mistake: one line, and under ``accelerate launch`` that line is the last one.

A launcher that sees a worker exit with a non-zero status prints its own report after the workers are gone:
``accelerate launch`` (torchrun's agent in its own process) raises ``ChildFailedError``, ~40 lines of traceback and
failure report, whatever the worker printed before. The one exit it reports without a word is its own termination
by a signal (``SignalException``: it stops the workers, then exits ``128 + signal``). So on a set-up mistake the main
process of an ``accelerate launch`` run asks the launcher to stop (SIGTERM to its parent, the agent) and prints its
line when the agent's SIGTERM reaches it, after the agent's two log lines: the user's last line is the example's,
and the exit status is 143. Plain ``torchrun`` prints a traceback for that signal too, so there (and in any other
parent) the line is printed at once and written to torchrun's error file, which its report then ends with.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent

#: transformers' message when ``attn_implementation="blockdiag_cp"`` was never registered.
_NOT_REGISTERED = 'attn_implementation="blockdiag_cp"` is not supported'

#: Seconds a process other than the main one waits before it exits on a set-up error. The main process meets the
#: same error, prints it and exits, and the launcher (torchrun) then ends the others; were another process to exit
#: first, torchrun would end the main one before it printed anything (seen on a loaded machine).
OTHER_RANKS_EXIT_AFTER_S = 10.0

#: Seconds the main process waits for the launcher's SIGTERM after asking it to stop (it then prints anyway).
LAUNCHER_STOP_WAIT_S = 20.0
#: Seconds the main process waits, once the launcher's SIGTERM came, for the launcher's own shutdown log lines.
AGENT_LOG_GRACE_S = 0.5

#: A Hugging Face hub id: ``name`` or ``namespace/name`` (what ``from_pretrained`` may look up when no such path).
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def launched_rank() -> int:
    """This process's global rank as the launcher set it (0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def check_paths(args: argparse.Namespace) -> None:
    """``--model`` and ``--data`` that name a file or directory must exist (``SystemExit`` with one line).

    A name that could be a hub id (``--model namespace/name``) or a ``datasets`` name is left to the library."""
    model = args.model
    if not os.path.exists(model) and (model.endswith(".json") or not _HUB_ID.fullmatch(model)):
        raise SystemExit(f"--model {model}: no such file or directory (give a config *.json, a local model "
                         "directory or a hub id such as namespace/name)")
    data = getattr(args, "data", None)
    if data and not glob.has_magic(data) and not os.path.exists(data) and (
            data.endswith((".jsonl", ".json", ".txt")) or data.startswith(("/", ".", "~"))):
        raise SystemExit(f"--data {data}: no such file or directory")


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
    """Set-up mistakes end the run with one line on the main process instead of a traceback on every rank: the
    package's refusals and the examples' checks (``ValueError`` / ``NotImplementedError`` raised in
    ``hf_blockdiag_cp`` or ``examples``, whose messages name the fix; ``SystemExit`` with a message) and transformers'
    unknown ``attn_implementation="blockdiag_cp"`` (with the hint). Wrap the set-up only: it is the same on every
    rank, while an error during training may come from one rank alone and keeps its traceback."""
    try:
        yield
    except SystemExit as err:
        if not isinstance(err.code, str):
            raise
        _exit_with(err.code)
    except (ValueError, NotImplementedError) as err:
        message = str(err)
        if _NOT_REGISTERED in message:
            message = ('attn_implementation="blockdiag_cp" is not registered with transformers: '
                       "`import hf_blockdiag_cp` before loading the model (the import registers it)")
        elif not _raised_here(err):
            raise
        _exit_with(f"{type(err).__name__}: {message}")


def _raised_here(err: BaseException) -> bool:
    """Whether ``err`` was raised by the package or by an example (not by a library they call)."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    module = str(tb.tb_frame.f_globals.get("__name__", ""))
    in_examples = Path(tb.tb_frame.f_code.co_filename).resolve().parent == EXAMPLES
    return module.split(".")[0] == "hf_blockdiag_cp" or in_examples


def _exit_with(message: str) -> None:
    """Exit status 2 with ``error: message`` on the main process (see the module docstring for the launcher)."""
    if launched_rank() == 0:
        line = f"error: {message}"
        _write_launcher_error(line)
        _stop_accelerate_launcher(line)  # returns only where there is no such launcher, or it did not answer
        print(line, file=sys.stderr, flush=True)
    else:
        time.sleep(OTHER_RANKS_EXIT_AFTER_S)
    raise SystemExit(2)


def _write_launcher_error(line: str) -> None:
    """Give torchrun the one line as this rank's error: its failure report, printed after the ranks exit, then ends
    with ``traceback : <line>`` instead of "To enable traceback see ..."."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"message": line, "timestamp": int(time.time())}, fh)
    except OSError:
        pass  # the line is on stderr already


def accelerate_agent_pid() -> int | None:
    """The pid of the ``accelerate launch`` process running torchrun's agent that started this worker, else None.

    Both must hold: the agent's environment (``TORCHELASTIC_RUN_ID``) and a parent whose command line is
    ``accelerate launch`` (Linux ``/proc``): no other parent (a shell, a test's fork server) is ever signalled."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    parent = os.getppid()
    try:
        argv = Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    words = [os.path.basename(a.decode(errors="replace")) for a in argv if a]
    by_accelerate = ("accelerate.commands.launch" in words or "accelerate-launch" in words
                     or ("accelerate" in words and "launch" in words))
    return parent if by_accelerate else None


def _stop_accelerate_launcher(line: str) -> None:
    """Under ``accelerate launch``: SIGTERM the agent, print ``line`` when its SIGTERM comes back, exit at once."""
    agent = accelerate_agent_pid()
    if agent is None:
        return

    def print_and_exit(signum: int, frame: object) -> None:
        # The agent signals its workers one by one, logging a line for each: let it log the others' first (seen on a
        # loaded machine: "Sending process ... closing signal SIGTERM" for the second worker after our line).
        time.sleep(AGENT_LOG_GRACE_S)
        print(line, file=sys.stderr, flush=True)
        os._exit(2)  # the agent is waiting for this process to end; nothing of the set-up needs cleaning

    signal.signal(signal.SIGTERM, print_and_exit)
    os.kill(agent, signal.SIGTERM)
    deadline = time.monotonic() + LAUNCHER_STOP_WAIT_S
    while time.monotonic() < deadline:  # sleep returns early when the signal's handler has run; it exits
        time.sleep(0.1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
