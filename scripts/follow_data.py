"""Follow one tensor through one served call, as data, and count the package functions it visits.

Two gloo ranks at CP = 2 run one forward of a tiny model built from its config (no download) on the package's own
collator; on rank 0 the call under study is traced:

- default: ``key`` through the first ``"blockdiag_cp"`` attention call of a tiny Llama
  (from :func:`hf_blockdiag_cp.integration.blockdiag_cp_attention` in);
- ``--recurrent``: the ``hidden_states`` given to the first served recurrent mixer of a tiny hybrid (``qwen3_next``'s
  gated-delta-rule layer, or ``--model bamba``'s Mamba2 mixer), from that mixer's ``forward`` in.

Definitions (what the numbers mean):

- *followed data*: the traced tensor and everything derived from it. A torch function mode marks the outputs of every
  torch operation (views included) that takes followed data (inside custom autograd functions too).
- *visit*: a call of a function defined in a file of ``hf_blockdiag_cp/`` that takes followed data among its
  arguments (directly, in a tuple / list / dict argument, or as a field of an object argument, one level deep).
  A kernel counts as one visit: the attention backend a layer calls (a function in ``hf_blockdiag_cp/kernels/``) or a
  recurrent op (``hf_blockdiag_cp/recurrent/ops/``); the calls made inside it are its own algorithm, not followed.
- *where the data is*: the module of the innermost visited function still running. It changes at each visit into
  another module and at each return from a visit to a caller in another module.
- *re-entry*: a change of where the data is into a module it had already been in and left during the call (a return
  to the caller's module counts: the data came back).

Prints one line per visit and a summary; ``--json`` prints the summary as JSON on the last line (for tests).

Example::

    python scripts/follow_data.py            # key through one CP = 2 attention call
    python scripts/follow_data.py --recurrent  # a GDN layer's hidden states at CP = 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, also in the spawned ranks (they import this module)
PACKAGE = str(ROOT / "hf_blockdiag_cp") + os.sep
DOC_LENGTHS = (5, 20, 3, 12, 8)  # 48 tokens: at CP = 2 the second document straddles the ranks
SEQ_LEN = 48
KERNELS = ("kernels" + os.sep, os.path.join("recurrent", "ops") + os.sep)  # followed up to their entry only
MODEL_CODE = "(the model's own code)"  # where the data is inside transformers (not a visit, not a re-entry)


class _Followed:
    """The followed tensors (by identity; kept alive so that ids are not reused during the call)."""

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self.keep: list[torch.Tensor] = []

    def add(self, value: Any) -> None:
        for t in tree_flatten(value)[0]:
            if isinstance(t, torch.Tensor) and id(t) not in self.ids:
                self.ids.add(id(t))
                self.keep.append(t)

    def holds(self, value: Any, depth: int = 1) -> bool:
        if isinstance(value, torch.Tensor):
            return id(value) in self.ids
        if depth < 0:
            return False
        if isinstance(value, (tuple, list)):
            return any(self.holds(v, depth - 1) for v in value)
        if isinstance(value, dict):
            return any(self.holds(v, depth - 1) for v in value.values())
        fields = getattr(value, "__dict__", None)
        if isinstance(fields, dict) and not isinstance(value, (torch.nn.Module, type)):
            return any(self.holds(v, depth - 1) for v in fields.values())
        return False


class _Derive(TorchFunctionMode):
    """Marks the outputs of every torch operation on followed data as followed."""

    def __init__(self, followed: _Followed) -> None:
        super().__init__()
        self.followed = followed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.followed.ids and any(isinstance(t, torch.Tensor) and id(t) in self.followed.ids
                                     for t in tree_flatten((args, kwargs))[0]):
            self.followed.add(out)
        return out


class _Tracer:
    """A ``sys.setprofile`` function counting visits and re-entries of the followed data (module docstring)."""

    def __init__(self, start: Any, argument: str) -> None:
        self.start, self.argument = start, argument  # (code name, predicate on the frame), the followed argument
        self.followed = _Followed()
        self.active = False
        self.done = False
        self.stack: list[tuple[Any, str]] = []  # visited frames still running, with their module
        self.visits: list[tuple[str, str]] = []
        self.where: str | None = None
        self.seen: set[str] = set()
        self.reentries: list[str] = []
        self.kernel_frame = None

    def _move(self, module: str | None) -> None:
        if module is None or module == self.where:
            return
        if module in self.seen and module != MODEL_CODE:
            self.reentries.append(module)
        self.seen.add(module)
        self.where = module

    def __call__(self, frame, event: str, arg: Any) -> None:
        if event not in ("call", "return") or self.done:
            return
        if not self.active:
            if event == "call" and self.start(frame):
                self.active = True
                self.followed.add(frame.f_locals[self.argument])
                self._enter(frame)
            return
        if self.kernel_frame is not None:  # inside the kernel: its own algorithm, not followed
            if event == "return" and frame is self.kernel_frame:
                self.kernel_frame = None
                self._returned(frame)
            return
        if event == "call":
            if frame.f_code.co_filename.startswith(PACKAGE) and any(self.followed.holds(v)
                                                                    for v in frame.f_locals.values()):
                self._enter(frame)
        else:
            self._returned(frame)

    def _enter(self, frame) -> None:
        path = frame.f_code.co_filename
        module = path[len(PACKAGE):] if path.startswith(PACKAGE) else MODEL_CODE
        self.stack.append((frame, module))
        if module != MODEL_CODE:
            self.visits.append((module, frame.f_code.co_qualname))
        self._move(module)
        if module.startswith(KERNELS):
            self.kernel_frame = frame

    def _returned(self, frame) -> None:
        if not self.stack or self.stack[-1][0] is not frame:
            return
        self.stack.pop()
        if not self.stack:
            self.done = True
            return
        self._move(self.stack[-1][1])

    def summary(self) -> dict[str, Any]:
        modules = list(dict.fromkeys(m for m, _ in self.visits))
        return {"visits": len(self.visits), "modules": len(modules), "reentries": len(self.reentries),
                "path": [f"{m}:{q}" for m, q in self.visits], "module_order": modules}


def _attention_start(frame) -> bool:
    return frame.f_code.co_name == "blockdiag_cp_attention" and frame.f_code.co_filename.startswith(PACKAGE)


def _mixer_start(kind: str):
    names = {"qwen3_next": "Qwen3NextGatedDeltaNet", "bamba": "BambaMixer"}

    def start(frame) -> bool:
        this = frame.f_locals.get("self")
        return frame.f_code.co_name == "forward" and type(this).__name__ == names[kind]
    return start


def _worker(rank: int, world: int, init: str, model_kind: str, recurrent: bool, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        import hf_blockdiag_cp as bd
        from hf_blockdiag_cp.conformance.configs import tiny_config
        from hf_blockdiag_cp.conformance.runs import build_model

        config = tiny_config(model_kind)
        model = build_model(config, "blockdiag_cp").train()
        gen = torch.Generator().manual_seed(7)
        docs = [{"input_ids": torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()} for n in DOC_LENGTHS]
        collator = bd.PackingCollator(SEQ_LEN, group=dist.group.WORLD, pad_token_id=0)
        batch = collator(docs)
        tracer = None
        if rank == 0:
            tracer = _Tracer(_mixer_start(model_kind) if recurrent else _attention_start,
                             "hidden_states" if recurrent else "key")
            sys.setprofile(tracer)
        try:
            with _Derive(tracer.followed) if tracer is not None else _nullcontext():
                out = model(**{k: v for k, v in batch.items() if k not in ("labels", "use_cache")}, use_cache=False)
        finally:
            sys.setprofile(None)
        out.logits.float().square().mean().backward()
        if tracer is not None:
            Path(out_path).write_text(json.dumps(tracer.summary()))
        # Settle gloo's workers before the group goes: the batch's context still holds it, and a group freed at
        # interpreter shutdown with a busy worker aborts the rank (docs/trainer.md, "Ending the run").
        bd.training.close_process_groups()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recurrent", action="store_true", help="follow a recurrent layer's hidden states")
    parser.add_argument("--model", default=None, help="model_type (default: llama, or qwen3_next with --recurrent)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON on the last line")
    args = parser.parse_args(argv)
    kind = args.model or ("qwen3_next" if args.recurrent else "llama")
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "summary.json")
        init = "file://" + os.path.join(tmp, "store")
        mp.start_processes(_worker, args=(2, init, kind, args.recurrent, out_path), nprocs=2, join=True,
                           start_method="spawn")
        summary = json.loads(Path(out_path).read_text())
    what = (f"{kind} hidden_states through its first served mixer" if args.recurrent
            else "key through one attention call")
    print(f"followed {what} at CP = 2:")
    for step in summary["path"]:
        print(f"  {step}")
    print(f"{summary['visits']} visits over {summary['modules']} modules, {summary['reentries']} re-entries")
    if args.json:
        print(json.dumps({k: summary[k] for k in ("visits", "modules", "reentries")}))
    return summary


if __name__ == "__main__":
    main()
