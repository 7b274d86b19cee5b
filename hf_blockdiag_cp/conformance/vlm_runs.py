"""The conformance check of image-text-to-text (vision-language) architectures, issue 32: four verdicts per
architecture with a synthetic-document fixture (:data:`~.multimodal.VLM_TYPES`) — text-only packed rows and packed rows
with images, each at CP = 1 and on ``cp_size`` spawned gloo ranks — against each document alone through the stock
model (:func:`~.multimodal.documents_alone`): logits, the token-sum loss and every parameter's gradient, the vision
tower's included. The package's model is built with the plain string ``attn_implementation="blockdiag_cp"`` (its
vision tower then runs transformers' stock attention) and fed :class:`~hf_blockdiag_cp.PackingCollator` batches.

Every other image-text-to-text architecture of the installed transformers gets :data:`NOT_CHECKED` verdicts: the
check claims nothing about them. :func:`vlm_sweep` runs the checks in subprocesses (a crash or a hang cannot stop it);
:mod:`.vlm_report` writes them as docs/models.md's section.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from ..data import PackingCollator
from .launch import spawn_ranks
from .multimodal import (
    IDS,
    VLM_TYPES,
    AloneResult,
    build_vlm,
    compare,
    documents_alone,
    make_stateful,
    synthetic_documents,
    tiny_vlm_config,
)
from .result import EXACT, FAIL, GRAD_RTOL, LOGITS_ATOL, NOT_APPLICABLE, REFUSED, describe_error, is_refusal, shorten
from .sweep import _limit_memory

__all__ = ["IMAGE_SPECS", "LOSS_RTOL", "NOT_CHECKED", "NO_FIXTURE", "PLACEMENTS", "TEXT_SPEC", "VlmVerdict",
           "check_vlm", "not_checked", "read_vlm_jsonl", "vlm_cases", "vlm_sweep", "vlm_types"]

#: The verdict of an architecture the check has no synthetic documents for (nothing is claimed about it).
NOT_CHECKED = "not checked"
NO_FIXTURE = "no synthetic-document fixture"
#: Tolerance of the token-sum loss (relative), with :data:`~.result.LOGITS_ATOL` and :data:`~.result.GRAD_RTOL`.
LOSS_RTOL = GRAD_RTOL
#: Text-only documents (the same tokens drawn as the image documents' text).
TEXT_SPEC: dict[str, Any] = dict(num_docs=4, seed=7, images=(0,))
#: Image document sets, tried in order until one places an image across two ranks (each has a document with two
#: images and, but the last, one without any).
IMAGE_SPECS: tuple[dict[str, Any], ...] = (
    dict(num_docs=4, seed=7, images=(1, 2, 0, 1)), dict(num_docs=3, seed=7, images=(2, 1, 0), text_len=(10, 40)),
    dict(num_docs=2, seed=3, images=(2, 0), text_len=(4, 10)), dict(num_docs=2, seed=5, images=(2, 1), text_len=(2, 6)))
#: Placements tried under CP, in order, for a row that cuts an image (a document) between two ranks.
PLACEMENTS = ("balanced", "zigzag", "contiguous")


@dataclass
class VlmVerdict:
    """One of an architecture's four verdicts.

    Attributes:
        model: the model type.
        images: whether the packed documents hold images (``False``: text-only documents).
        cp_size: ranks of the packed run (1 or the check's CP size).
        status: ``exact`` / ``refused`` / ``FAIL`` / ``n/a`` / ``not checked``.
        reason: the refusal message, the failure (with its numbers), or why it does not apply.
        logits_err: max abs logits difference over the documents' real tokens.
        loss_err: relative difference of the token-sum loss.
        grad_err: worst relative gradient difference of a parameter (vision tower and projector included).
        layout: the packed row: its length, the placement and whether an image / a document is cut between ranks.
        seconds: wall time of this case (the reference run shared out).
        transformers: the transformers version.
    """

    model: str
    images: bool
    cp_size: int
    status: str = EXACT
    reason: str = ""
    logits_err: float | None = None
    loss_err: float | None = None
    grad_err: float | None = None
    layout: str = ""
    seconds: float = 0.0
    transformers: str = ""

    @property
    def case(self) -> str:
        """``text-only, CP = 1`` / ``images, CP = 2`` ..."""
        return f"{'images' if self.images else 'text-only'}, CP = {self.cp_size}"

    def line(self) -> str:
        """One human-readable line: model [case]: verdict (reason) | numbers | layout | seconds."""
        nums = [f"{name} {value:.1e}" for name, value in (("logits", self.logits_err), ("loss", self.loss_err),
                                                           ("grads", self.grad_err)) if value is not None]
        head = f"{self.model} [{self.case}]: {self.status}" + (f" ({self.reason})" if self.reason else "")
        return " | ".join([head, ", ".join(nums) or "-", self.layout or "-", f"{self.seconds:.1f} s"])


def vlm_types() -> list[str]:
    """Every image-text-to-text ``model_type`` of the installed transformers (``MODEL_FOR_IMAGE_TEXT_TO_TEXT``)."""
    return list(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def vlm_cases(cp_size: int) -> list[tuple[bool, int]]:
    """``(images, cp_size)`` of the verdicts, in table order: text-only then images at CP = 1, then at ``cp_size``."""
    sizes = [1] if cp_size == 1 else [1, cp_size]
    return [(images, size) for size in sizes for images in (False, True)]


def not_checked(model_type: str, cp_size: int = 2) -> list[VlmVerdict]:
    """The verdicts of an architecture without a fixture: :data:`NOT_CHECKED`, nothing claimed."""
    return [VlmVerdict(model_type, images, size, NOT_CHECKED, NO_FIXTURE, transformers=transformers.__version__)
            for images, size in vlm_cases(cp_size)]


def check_vlm(model_type: str, *, cp_size: int = 2, seed: int = 0) -> list[VlmVerdict]:
    """The verdicts of one image-text-to-text architecture (:func:`vlm_cases` of ``cp_size``); an architecture
    without a fixture gets :func:`not_checked`."""
    if model_type not in VLM_TYPES:
        return not_checked(model_type, cp_size)
    start = time.monotonic()
    verdicts = [VlmVerdict(model_type, images, size, transformers=transformers.__version__)
                for images, size in vlm_cases(cp_size)]
    try:
        _check(model_type, verdicts, cp_size, seed)
    except Exception as err:  # the fixture, the stock model or the reference broke: nothing was compared
        for v in verdicts:
            if not v.reason and v.logits_err is None:
                v.status, v.reason = FAIL, f"check crashed: {describe_error(err)}"
        print(traceback.format_exc()[-2000:], file=sys.stderr)
    for v in verdicts:
        v.seconds = v.seconds or (time.monotonic() - start) / len(verdicts)
    return verdicts


def _check(model_type: str, verdicts: list[VlmVerdict], cp_size: int, seed: int) -> None:
    config = tiny_vlm_config(model_type, seed=seed)
    stock = build_vlm(config, "sdpa")
    make_stateful(stock)  # Qwen3.5's gated-delta state must survive a document piece (tiny configs forget at once)
    try:
        ours = build_vlm(config, "blockdiag_cp")
        ours.load_state_dict(stock.state_dict())
    except Exception as err:  # refused (or broken) when the model is built: every case says so
        for v in verdicts:
            v.status, v.reason = (REFUSED if is_refusal(err) else FAIL), describe_error(err)
        return
    weights = {name: t.detach().numpy().copy() for name, t in ours.state_dict().items()}
    for images in (False, True):
        specs = IMAGE_SPECS if images else (TEXT_SPEC,)
        spec, placement, seq_len, layout = _row_layout(config, specs, max(cp_size, 2), images)
        docs = synthetic_documents(config, **spec)
        try:
            alone = documents_alone(stock, docs)
        except Exception as err:
            for v in verdicts:
                if v.images == images:
                    v.status, v.reason = NOT_APPLICABLE, f"stock model fails on a document alone: {describe_error(err)}"
            continue
        for v in (v for v in verdicts if v.images == images):
            started = time.monotonic()
            v.layout = f"row of {seq_len}" + (f", {placement} placement, {layout}" if v.cp_size > 1 else "")
            try:
                if v.cp_size == 1:
                    payloads = [_packed_pass(ours, docs, seq_len, None, None)]
                else:
                    payloads = spawn_ranks(_vlm_rank, (model_type, seed, weights, spec, seq_len, placement),
                                           v.cp_size)
                _judge(v, payloads, len(docs), alone)
            except Exception as err:
                v.status = REFUSED if is_refusal(err) else FAIL
                v.reason = _reason(err)
            v.seconds = time.monotonic() - started


def _reason(err: BaseException) -> str:
    """``describe_error`` of ``err``, once: an error re-raised from a rank already starts with its type name."""
    text = describe_error(err)
    head = f"{type(err).__name__}: "
    return text[len(head):] if text.startswith(head * 2) else text


def _row_layout(config: Any, specs: Sequence[dict[str, Any]], world: int, images: bool
                ) -> tuple[dict[str, Any], str, int, str]:
    """``(spec, placement, seq_len, what is cut)`` of the first document set, placement and row length (each
    divisible by ``2 * world``) at which an image (text-only: a document) has tokens on two of ``world`` ranks: the
    case the exchange must get right. The row length is used at CP = 1 too (host-only, the same for every run)."""
    unit = "an image" if images else "a document"
    for placement in PLACEMENTS:
        for spec in specs:
            docs = synthetic_documents(config, **spec)
            total = sum(len(d["input_ids"]) for d in docs)
            first = -(-total // (2 * world)) * 2 * world
            for seq_len in range(first, first + 32 * world, 2 * world):
                probe = PackingCollator(seq_len, cp_size=world, cp_rank=0, pad_token_id=IDS["pad"],
                                        model_config=config, placement=placement)
                if _cut(probe, docs, world, images):
                    return spec, placement, seq_len, f"{unit} cut between the ranks"
    spec = specs[0]
    total = sum(len(d["input_ids"]) for d in synthetic_documents(config, **spec))
    return spec, PLACEMENTS[0], -(-total // (2 * world)) * 2 * world, f"no {unit[3:]} cut between the ranks"


def _cut(collator: PackingCollator, docs: list[dict[str, Any]], world: int, images: bool) -> bool:
    """Whether an image's placeholder run (``images=False``: a document) has tokens on two ranks."""
    ctx = collator(docs)["cp_context"]
    packed = collator.pack(docs)[0].documents
    owner = torch.empty(ctx.full_len, dtype=torch.int64)
    for rank in range(world):
        owner[ctx.placement.positions(rank)] = rank
    if images:
        row = torch.cat([d.input_ids for d in packed])
        positions = torch.nonzero(row == collator.media.token_ids["image"]).flatten()
        bounds = torch.tensor([0, *ctx.media.rows]).cumsum(0).tolist() if ctx.media is not None else [0]
    else:
        positions = torch.arange(sum(len(d.input_ids) for d in packed))
        bounds = torch.tensor([0, *(len(d.input_ids) for d in packed)]).cumsum(0).tolist()
    return any(len(set(owner[positions[a:b]].tolist())) > 1 for a, b in zip(bounds, bounds[1:]))


def _packed_pass(model: torch.nn.Module, docs: list[dict[str, Any]], seq_len: int, group: Any,
                 placement: str | None) -> dict[str, Any]:
    """One rank's (``group=None``: the only) packed run of ``docs``: its logits ``[local_len, V]`` with their row
    positions, its part of the token-sum loss and of every gradient, and the documents' row order (numpy / plain
    data, to cross process boundaries)."""
    collator = PackingCollator(seq_len, group=group, pad_token_id=IDS["pad"], model_config=model.config,
                               placement=placement)
    rows = collator.pack(docs)
    if len(rows) != 1:
        raise RuntimeError(f"the check's documents need {len(rows)} rows of {seq_len}: a bug of the check")
    batch = collator(docs)
    model.zero_grad(set_to_none=True)
    out = model(**{"use_cache": False, **batch})  # the collator may set it already
    loss = out.loss * batch["num_items_in_batch"]  # this rank's part of the token sum
    loss.backward()
    return {"logits": out.logits[0].detach().float().numpy(),
            "local_index": batch["cp_context"].local_index.numpy(),
            "loss": float(loss.detach()),
            "grads": {n: p.grad.detach().numpy() for n, p in model.named_parameters() if p.grad is not None},
            "order": [(d.index, len(d.input_ids)) for d in rows[0].documents]}


def _vlm_rank(rank: int, world: int, model_type: str, seed: int, weights: dict[str, np.ndarray],
              spec: dict[str, Any], seq_len: int, placement: str) -> dict[str, Any]:
    """One CP rank (:func:`~.launch.spawn_ranks`): the parent's weights in a model built with the plain string
    ``"blockdiag_cp"``, this rank's shard of the packed row."""
    config = tiny_vlm_config(model_type, seed=seed)
    model = build_vlm(config, "blockdiag_cp")
    model.load_state_dict({name: torch.from_numpy(w) for name, w in weights.items()})
    return _packed_pass(model, synthetic_documents(config, **spec), seq_len, dist.group.WORLD, placement)


def _judge(verdict: VlmVerdict, payloads: list[dict[str, Any]], num_docs: int, alone: AloneResult) -> None:
    """Fill ``verdict`` from the ranks' ``payloads`` against the reference: exact within the tolerances, else FAIL
    with the numbers and the parameter whose gradient differs most."""
    width = payloads[0]["logits"].shape[-1]
    full = torch.zeros(max(int(p["local_index"].max()) for p in payloads) + 1, width)
    grads: dict[str, torch.Tensor] = {}
    for p in payloads:
        full[torch.from_numpy(p["local_index"])] = torch.from_numpy(p["logits"])
        for name, g in p["grads"].items():
            grads[name] = grads[name] + torch.from_numpy(g) if name in grads else torch.from_numpy(g).clone()
    by_doc: list[torch.Tensor] = [torch.empty(0)] * num_docs
    start = 0
    for index, length in payloads[0]["order"]:
        by_doc[index] = full[start:start + length]
        start += length
    loss = sum(p["loss"] for p in payloads)
    errors = compare(by_doc, loss, grads, alone)
    verdict.logits_err = max(float((a - b).abs().max()) for a, b in zip(by_doc, alone.logits))
    verdict.loss_err, verdict.grad_err = errors["loss"], errors["grads"]
    if verdict.logits_err <= LOGITS_ATOL and verdict.loss_err <= LOSS_RTOL and verdict.grad_err <= GRAD_RTOL:
        verdict.status = EXACT
        return
    worst = _worst_parameter(grads, alone)
    verdict.status = FAIL
    verdict.reason = (f"logits {verdict.logits_err:.1e} (tolerance {LOGITS_ATOL:g}), loss {verdict.loss_err:.1e}, "
                      f"grads {verdict.grad_err:.1e} (tolerance {GRAD_RTOL:g}; largest: {worst})")


def _worst_parameter(grads: dict[str, torch.Tensor], alone: AloneResult) -> str:
    """The parameter whose gradient differs most from the reference's, relative to its norm (key biases, whose true
    gradient is zero, left out as :func:`~.multimodal.compare` does)."""
    def error(name: str) -> float:
        ref = alone.grads.get(name)
        got = grads.get(name)
        ref = torch.zeros_like(got) if ref is None else ref
        got = torch.zeros_like(ref) if got is None else got
        return float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12))
    names = [n for n in set(grads) | set(alone.grads) if not n.endswith(("k_proj.bias", "self_attn.key.bias"))]
    return max(names, key=error) if names else "none"


def read_vlm_jsonl(path: Path) -> list[VlmVerdict]:
    """The image-text-to-text verdicts among a sweep's JSON lines (the last per model and case wins)."""
    out: dict[tuple[str, bool, int], VlmVerdict] = {}
    for line in path.read_text().splitlines():
        data = json.loads(line) if line.strip() else {}
        if "images" in data:
            v = VlmVerdict(**data)
            out[(v.model, v.images, v.cp_size)] = v
    return list(out.values())


def _run(types: Sequence[str], cp_size: int, timeout: float, python: str) -> list[VlmVerdict]:
    """``python -m hf_blockdiag_cp.check TYPES --vlm-only --json`` in one subprocess; types it did not report (it
    crashed or timed out) are checked again one per subprocess, and one still unreported is a FAIL."""
    cmd = [python, "-m", "hf_blockdiag_cp.check", *types, "--vlm-only", "--cp-size", str(cp_size), "--json"]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout * len(types),
                              preexec_fn=_limit_memory)
        stdout = proc.stdout
        failure = f"check process exited with {proc.returncode}: {shorten(proc.stderr[-400:], 300)}"
    except subprocess.TimeoutExpired as err:
        out = err.stdout or ""
        stdout = out.decode(errors="replace") if isinstance(out, bytes) else out
        failure = f"timed out after {timeout * len(types):.0f} s"
    got = [VlmVerdict(**json.loads(line)) for line in stdout.splitlines() if line.startswith("{")]
    for v in got:  # wall time, the process's start-up shared out
        v.seconds = (time.monotonic() - start) / len(got)
    done = {v.model for v in got if sum(u.model == v.model for u in got) == len(vlm_cases(cp_size))}
    got = [v for v in got if v.model in done]
    for model in (m for m in types if m not in done):
        if len(types) > 1:
            got += _run([model], cp_size, timeout, python)
        else:
            got += [VlmVerdict(model, images, size, FAIL, failure, transformers=transformers.__version__)
                    for images, size in vlm_cases(cp_size)]
    return got


def vlm_sweep(types: Sequence[str], *, cp_size: int = 2, timeout: float = 300.0, jsonl: Path | None = None,
              python: str = sys.executable) -> list[VlmVerdict]:
    """Every verdict of ``types`` (those with a fixture checked in subprocesses, ``timeout`` seconds per type; the
    others :func:`not_checked`), in the order of ``types``; appends them to ``jsonl`` and skips the types it already
    holds at this ``cp_size``. Prints one line per verdict."""
    done: dict[str, list[VlmVerdict]] = {}
    if jsonl is not None and jsonl.exists():
        for v in read_vlm_jsonl(jsonl):
            done.setdefault(v.model, []).append(v)
        done = {m: vs for m, vs in done.items() if {(v.images, v.cp_size) for v in vs} == set(vlm_cases(cp_size))}
    todo = [m for m in types if m in VLM_TYPES and m not in done]
    fresh = (_run(todo, cp_size, timeout, python) if todo else [])
    fresh += [v for m in types if m not in VLM_TYPES and m not in done for v in not_checked(m, cp_size)]
    for v in fresh:
        done.setdefault(v.model, []).append(v)
        if v.status != NOT_CHECKED:
            print(v.line(), flush=True)
        elif (v.images, v.cp_size) == (False, 1):
            print(f"{v.model}: {NOT_CHECKED} ({v.reason})", flush=True)
    if jsonl is not None and fresh:
        with jsonl.open("a") as f:
            f.writelines(json.dumps(asdict(v)) + "\n" for v in fresh)
    order = {case: i for i, case in enumerate(vlm_cases(cp_size))}
    return [v for m in types for v in sorted(done[m], key=lambda v: order.get((v.images, v.cp_size), 99))]
