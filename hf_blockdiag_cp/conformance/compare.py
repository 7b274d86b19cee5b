"""One architecture's verdict: packed documents under ``"blockdiag_cp"`` against each document alone
under stock attention (logits, gradients, per input variant) and ``generate()`` token for token."""

from __future__ import annotations

import time
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import transformers

from . import result as outcome
from .configs import VOCAB, composite_reason, text_config, tiny_config
from .launch import run_cp
from .result import EXACT, FAIL, GRAD_RTOL, LOGITS_ATOL, NOT_APPLICABLE, REFUSED, CheckResult, describe_error
from .runs import (
    VARIANTS,
    accepts_keyword,
    build_model,
    grad_error,
    make_documents,
    packed_inputs,
    packed_run,
    reference_run,
)

__all__ = ["check_generate", "check_model"]


def check_model(model_name: str, *, cp_size: int = 1, seed: int = 0, generate: bool = True,
                variants: Sequence[str] = VARIANTS) -> CheckResult:
    """Check one architecture (a ``model_type`` or a local config / model folder): the packed ``variants``
    against each document alone, the ``collator`` variant on ``cp_size`` gloo ranks, and ``generate()``."""
    start = time.monotonic()
    result = CheckResult(model=model_name, cp_size=cp_size, transformers=transformers.__version__)
    try:
        _check(model_name, result, cp_size=cp_size, seed=seed, generate=generate, variants=variants)
    except Exception as err:  # the config or the stock model cannot be built: nothing to compare
        result.status, result.reason = FAIL, f"check crashed: {describe_error(err)}"
        result.variants["traceback"] = traceback.format_exc()[-2000:]
    result.seconds = time.monotonic() - start
    return result


def _check(model_name: str, result: CheckResult, *, cp_size: int, seed: int, generate: bool,
           variants: Sequence[str]) -> None:
    try:
        config = tiny_config(model_name)
    except Exception as err:
        result.status, result.reason = NOT_APPLICABLE, f"no tiny config: {describe_error(err, 300)}"
        return
    composite = composite_reason(getattr(config, "model_type", model_name), config)
    if composite is not None:
        result.status, result.reason = NOT_APPLICABLE, composite
        return
    try:
        stock = build_model(config, None, seed)
    except Exception as err:
        result.status, result.reason = NOT_APPLICABLE, f"stock model cannot be built: {describe_error(err, 300)}"
        return
    try:  # before the reference: a model refused at load time is refused whatever the stock model does
        ours = build_model(config, "blockdiag_cp", seed)
        ours.load_state_dict(stock.state_dict())
    except Exception as err:
        result.status, result.reason = (REFUSED if outcome.is_refusal(err) else FAIL), describe_error(err)
        return
    docs = make_documents(config, seed)
    try:
        ref_logits, ref_grads = reference_run(stock, docs)
    except Exception as err:
        result.status = NOT_APPLICABLE
        result.reason = f"stock model fails on a document alone: {describe_error(err, 300)}"
        return
    pad = getattr(text_config(config), "pad_token_id", None)
    pad = pad if isinstance(pad, int) and 0 <= pad < VOCAB else 0
    worst_logits, worst_grads = 0.0, 0.0
    refusals: list[str] = []
    failures: list[str] = []
    for variant in variants:
        try:
            inputs = packed_inputs(docs, variant, pad_token_id=pad)
            missing = [k for k in inputs if not k.startswith("_") and not accepts_keyword(ours, k)]
            if missing:
                result.variants[variant] = f"skipped: forward takes no {', '.join(missing)}"
                continue
            if variant == "collator" and cp_size > 1:
                logits, grads = run_cp(config, docs, cp_size, seed, pad)
            else:
                logits, grads = packed_run(ours, docs, inputs)
        except Exception as err:
            if outcome.is_refusal(err):
                result.variants[variant] = f"refused: {describe_error(err)}"
                refusals.append(describe_error(err))
            else:
                result.variants[variant] = f"FAIL: {describe_error(err)}"
                failures.append(f"{variant}: {describe_error(err)}")
                result.variants[f"{variant}_traceback"] = traceback.format_exc()[-2000:]
            continue
        if logits.shape != ref_logits.shape:
            failures.append(f"{variant}: logits shape {tuple(logits.shape)} != {tuple(ref_logits.shape)}")
            result.variants[variant] = "FAIL: shape"
            continue
        err_l = float((logits - ref_logits).abs().max())
        err_g = grad_error(grads, ref_grads)
        worst_logits, worst_grads = max(worst_logits, err_l), max(worst_grads, err_g)
        ok = err_l <= LOGITS_ATOL and err_g <= GRAD_RTOL
        result.variants[variant] = f"{'ok' if ok else 'FAIL'} logits {err_l:.1e} grads {err_g:.1e}"
        if not ok:
            failures.append(f"{variant}: logits {err_l:.1e}, grads {err_g:.1e}")
    if any(v.startswith(("ok", "FAIL ")) for v in result.variants.values()):
        result.logits_err, result.grad_err = worst_logits, worst_grads
    if generate:
        result.generate = check_generate(stock, ours, config, seed)
        if result.generate == "different":
            failures.append("generate() differs from stock attention")
        elif result.generate.startswith("refused"):
            refusals.append(f"generate: {result.generate}")
        elif result.generate.startswith("FAIL"):
            failures.append(f"generate: {result.generate}")
    ran = [v for v in result.variants.values() if v.startswith(("ok", "FAIL"))]
    if failures:
        result.status, result.reason = FAIL, "; ".join(failures)
    elif refusals:
        result.status, result.reason = REFUSED, refusals[0]
    elif not ran:
        result.status = REFUSED
        result.reason = "; ".join(f"{k}: {v}" for k, v in result.variants.items())
    else:
        result.status = EXACT


def _generate(model: torch.nn.Module, config: Any, seed: int) -> torch.Tensor:
    """Greedy ``generate()`` of 6 tokens for a left-padded batch of two random prompts: ``[2, 12]``."""
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = int(getattr(text_config(config), "vocab_size", VOCAB) or VOCAB)
    prompt = torch.randint(3, min(vocab, VOCAB), (2, 6), generator=gen)
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # left padding, as generate() expects
    pad = getattr(text_config(config), "pad_token_id", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False,
                              pad_token_id=pad if isinstance(pad, int) else 0)


def check_generate(stock: torch.nn.Module, ours: torch.nn.Module, config: Any, seed: int = 0) -> str:
    """``generate()`` of ``ours`` against ``stock`` (same weights): ``equal``, ``different``,
    ``refused: ...``, ``FAIL: ...`` or ``n/a (stock generate fails: ...)``."""
    try:
        expected = _generate(stock, config, seed)
    except Exception as err:
        return f"n/a (stock generate fails: {describe_error(err, 200)})"
    try:
        got = _generate(ours, config, seed)
    except Exception as err:
        if outcome.is_refusal(err):
            return f"refused: {describe_error(err, 400)}"
        return f"FAIL: {describe_error(err, 400)}"
    return "equal" if got.shape == expected.shape and torch.equal(got, expected) else "different"
