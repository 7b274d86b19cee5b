"""``python -m hf_blockdiag_cp.check`` / ``hf-blockdiag-cp-check``: check architectures one by one, or sweep
every causal LM and write docs/models.md and the README summary from the same results; image-text-to-text types
get their four verdicts from :mod:`.vlm_runs` (written as docs/models.md's own section by :mod:`.vlm_report`).
Mistakes the tool can see (an unknown model, a CP size it cannot run, a launch under ``torchrun``) end in one line
naming the fix, not a traceback."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from .compare import check_model
from .configs import causal_lm_types
from .report import markdown_table, readme_summary, replace_readme_summary
from .result import EXACT, FAIL, NOT_APPLICABLE, REFUSED, CheckResult
from .runs import LENGTHS
from .sweep import cp2_sample, read_jsonl, read_jsonl_ulysses, sweep
from .vlm_report import replace_vlm_section, vlm_section, vlm_section_of
from .vlm_runs import NOT_CHECKED, VlmVerdict, check_vlm, read_vlm_jsonl, vlm_sweep, vlm_types

__all__ = ["EXIT_CODES", "main", "usage_error"]

DESCRIPTION = ("Conformance check: does attn_implementation='blockdiag_cp' compute exactly what an architecture "
               "asks for? Packed documents against each document alone under stock attention.")
#: Exit status per verdict of a checked model (the command exits with the largest; 2 is a usage error).
EXIT_CODES = {EXACT: 0, FAIL: 1, REFUSED: 3, NOT_APPLICABLE: 4, NOT_CHECKED: 4}
EXIT_CODES_HELP = ("exit status: 0 every model exact, 1 a FAIL, 2 a usage error, 3 refused (the package refuses "
                   "what the architecture asks for), 4 not applicable (or an image-text-to-text type without a "
                   "fixture: not checked); the largest over the models checked")
#: Launchers that start several copies of a program (each would run the whole check and spawn its own ranks).
_LAUNCHER_VARIABLES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE")


def usage_error(models: Sequence[str], cp_size: int, environ: dict[str, str] | None = None) -> str | None:
    """The one-line message (with the fix) for a command line the check cannot run, or ``None``."""
    environ = dict(os.environ) if environ is None else environ
    launched = {v: environ[v] for v in _LAUNCHER_VARIABLES if environ.get(v, "1") not in ("", "1")}
    if launched:
        first = next(iter(launched.items()))
        return (f"the check starts its own {cp_size} gloo rank(s) for --cp-size {cp_size}: run it as one process, "
                f"not under torchrun / accelerate launch ({first[0]}={first[1]} here)")
    if cp_size < 1:
        return f"--cp-size {cp_size}: give a number of CP ranks >= 1 (the check spawns them itself)"
    tokens = sum(LENGTHS)
    if cp_size > tokens:
        return f"--cp-size {cp_size}: the check's packed row has {tokens} tokens; give at most {tokens} ranks"
    for model in models:
        if not Path(model).exists() and model not in CONFIG_MAPPING_NAMES:
            close = difflib.get_close_matches(model, causal_lm_types(), n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else " (`--all` checks every one)"
            return (f"{model!r} is neither a model_type of the installed transformers nor a local config.json / "
                    f"model folder{hint}")
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-blockdiag-cp-check", description=DESCRIPTION, epilog=EXIT_CODES_HELP)
    parser.add_argument("model", nargs="*", help="model_type(s) of transformers' causal-LM mapping, or local "
                                                 "config.json / model folders")
    parser.add_argument("--cp-size", type=int, default=None,
                        help="also run the collator path on N gloo ranks (spawned by the check: run it as one "
                             "process); default 1, and 2 for the CP verdicts of image-text-to-text types")
    parser.add_argument("--vlm-only", action="store_true",
                        help="only the image-text-to-text verdicts (text-only and image rows at CP = 1 and at "
                             "--cp-size): of the named types (also those that are causal LMs: gemma3, qwen3_5), or "
                             "with --all of every such type; --markdown then rewrites only its section")
    parser.add_argument("--ulysses-size", type=int, default=1,
                        help="the collator path's head-parallel size at --cp-size N (it must divide N and the heads); "
                             "with --all: also run the CP = 2 pass at this ulysses_size (a column in --markdown)")
    parser.add_argument("--all", action="store_true", help="sweep every causal LM of the installed transformers")
    parser.add_argument("--markdown", type=Path, help="with --all: write the Markdown table here (docs/models.md)")
    parser.add_argument("--readme", type=Path, help="with --all: rewrite the summary block of this README")
    parser.add_argument("--jsonl", type=Path, help="with --all: append results here (and resume from it)")
    parser.add_argument("--jobs", type=int, default=1, help="with --all: architectures checked at the same time")
    parser.add_argument("--timeout", type=float, default=300.0, help="with --all: seconds per architecture")
    parser.add_argument("--batch", type=int, default=1,
                        help="with --all: architectures per check process (one import, one fork server for the CP "
                             "ranks; a crashed process's architectures are checked again one per process)")
    parser.add_argument("--cp2-sample", type=int, default=0,
                        help="with --all: also check this many exact architectures at CP=2")
    parser.add_argument("--cp2-also", default="", help="with --all: comma-separated model types also checked at "
                                                       "CP=2, whatever their CP=1 result")
    parser.add_argument("--from-jsonl", action="store_true",
                        help="with --jsonl and --markdown / --readme: only rewrite the docs from a finished sweep")
    parser.add_argument("--no-generate", action="store_true", help="skip the generate() comparison")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    parser.add_argument("--verbose", action="store_true", help="print every variant and tracebacks")
    return parser


def _write_docs(args: argparse.Namespace, results: list[CheckResult], cp2: list[CheckResult],
                seconds: float | None, command: str, cp2_ulysses: list[CheckResult] = (),
                vlm: list[VlmVerdict] = ()) -> None:
    """docs/models.md (the causal-LM sections when ``results`` holds any, the VLM section when ``vlm`` does; a part
    not given keeps what the file has) and the README's summary."""
    if args.markdown is not None:
        old = args.markdown.read_text() if args.markdown.exists() else ""
        text = old
        if results:
            text = markdown_table(results, title="Architecture conformance", seconds=seconds, cp2=cp2,
                                  command=command, cp2_ulysses=cp2_ulysses)
        section = vlm_section(vlm, command=_vlm_command(args)) if vlm else vlm_section_of(old)
        args.markdown.write_text(replace_vlm_section(text, section) if section else text)
    if args.readme is not None and results:
        args.readme.write_text(replace_readme_summary(args.readme.read_text(), readme_summary(results, cp2)))


def _vlm_command(args: argparse.Namespace) -> str:
    """The command that writes the VLM section again (its own line in the section)."""
    if args.from_jsonl:
        parts = [f"python -m hf_blockdiag_cp.check --from-jsonl --jsonl {args.jsonl.name} --vlm-only"]
    else:
        parts = ["python -m hf_blockdiag_cp.check --all --vlm-only"]
        if args.cp_size is not None:
            parts.append(f"--cp-size {args.cp_size}")
    return " ".join([*parts, f"--markdown {args.markdown}"])


def _vlm_cp_size(args: argparse.Namespace) -> int:
    return 2 if args.cp_size is None else args.cp_size


def _check_vlm_types(args: argparse.Namespace, model: str) -> int:
    """One image-text-to-text type's verdicts, printed (lines or JSON); returns the exit status."""
    verdicts = check_vlm(model, cp_size=_vlm_cp_size(args))
    for v in verdicts:
        print(json.dumps(asdict(v)) if args.json else v.line(), flush=True)
    return max(EXIT_CODES[v.status] for v in verdicts)


def _sweep_command(args: argparse.Namespace) -> str:
    if args.from_jsonl:  # the docs rewritten from JSON lines: say so, not which sweep wrote them
        parts = [f"python -m hf_blockdiag_cp.check --from-jsonl --jsonl {args.jsonl.name}"]
    else:
        parts = ["python -m hf_blockdiag_cp.check --all"]
    if args.cp2_sample and not args.from_jsonl:
        parts.append(f"--cp2-sample {args.cp2_sample}")
    if args.cp2_also and not args.from_jsonl:
        parts.append(f"--cp2-also {shlex.quote(args.cp2_also)}")
    if args.ulysses_size > 1 and not args.from_jsonl:
        parts.append(f"--ulysses-size {args.ulysses_size}")
    parts += [f"--{name} {getattr(args, name)}" for name in ("markdown", "readme") if getattr(args, name)]
    return " ".join(parts)


def _run_all(args: argparse.Namespace) -> int:
    if args.vlm_only:
        vlm = vlm_sweep(vlm_types(), cp_size=_vlm_cp_size(args), timeout=args.timeout, jsonl=args.jsonl)
        _write_docs(args, [], [], None, "", vlm=vlm)
        return 1 if any(v.status == FAIL for v in vlm) else 0
    start = time.monotonic()
    results = sweep(causal_lm_types(), cp_size=1, timeout=args.timeout, jsonl=args.jsonl,
                    jobs=args.jobs, batch=args.batch)
    also = [m for m in args.cp2_also.split(",") if m]
    cp2: list[CheckResult] = []
    if args.cp2_sample or also:
        # generate() does not depend on the CP size: the CP = 1 row has compared it already.
        cp2 = sweep(cp2_sample(results, args.cp2_sample, also), cp_size=2, timeout=args.timeout, jsonl=args.jsonl,
                    jobs=args.jobs, batch=args.batch, generate=False)
    cp2_ulysses: list[CheckResult] = []
    if args.ulysses_size > 1 and cp2:  # the same architectures, head-parallel
        cp2_ulysses = sweep([r.model for r in cp2], cp_size=2, timeout=args.timeout, jsonl=args.jsonl, jobs=args.jobs,
                            batch=args.batch, generate=False, ulysses_size=args.ulysses_size)
    vlm = vlm_sweep(vlm_types(), cp_size=_vlm_cp_size(args), timeout=args.timeout, jsonl=args.jsonl)
    seconds = time.monotonic() - start
    counts = {s: sum(r.status == s for r in results) for s in (EXACT, REFUSED, FAIL, NOT_APPLICABLE)}
    print(f"{len(results)} architectures: " + ", ".join(f"{v} {k}" for k, v in counts.items())
          + f" ({seconds / 60:.1f} min)")
    _write_docs(args, results, cp2, seconds, _sweep_command(args), cp2_ulysses, vlm)
    failed = counts[FAIL] or any(r.status == FAIL for r in (*cp2, *cp2_ulysses, *vlm))
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see ``--help``); returns the exit status: the largest of :data:`EXIT_CODES` over the models
    checked (0 every one exact, 1 a FAIL, 2 a usage error, 3 refused, 4 not applicable)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.from_jsonl:
        if args.jsonl is None or (args.markdown is None and args.readme is None):
            parser.error("--from-jsonl needs --jsonl and --markdown or --readme")
        one, more = ([], []) if args.vlm_only else read_jsonl(args.jsonl)
        _write_docs(args, one, more, None, _sweep_command(args), [] if args.vlm_only else
                    read_jsonl_ulysses(args.jsonl), read_vlm_jsonl(args.jsonl))
        return 0
    problem = usage_error(args.model, 1 if args.cp_size is None else args.cp_size)
    if problem is None and args.vlm_only and not args.all:
        others = [m for m in args.model if m not in vlm_types()]
        if others:
            problem = f"--vlm-only: {', '.join(others)} is not an image-text-to-text model type"
    if problem is not None:
        print(f"hf-blockdiag-cp-check: error: {problem}", file=sys.stderr)
        return 2
    if args.all:
        return _run_all(args)
    if not args.model:
        parser.error("name a model type or path, or pass --all")
    status = 0
    causal = set(causal_lm_types())
    for model in args.model:
        if model in vlm_types() and (args.vlm_only or model not in causal):
            status = max(status, _check_vlm_types(args, model))
            continue
        sink = io.StringIO() if args.json else None
        with contextlib.redirect_stdout(sink) if sink is not None else contextlib.nullcontext():
            result = check_model(model, cp_size=args.cp_size or 1, generate=not args.no_generate,
                                 ulysses_size=args.ulysses_size)
        if args.json:
            data = asdict(result)
            if not args.verbose:
                data["variants"] = {k: v for k, v in data["variants"].items() if not k.endswith("traceback")}
            print(json.dumps(data))
        else:
            print(result.line())
            if args.verbose or result.status == FAIL:
                for name, value in result.variants.items():
                    print(f"  {name}: {value}")
        status = max(status, EXIT_CODES[result.status])
    return status
