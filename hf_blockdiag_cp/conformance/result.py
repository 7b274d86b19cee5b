"""What one architecture's check reports: :class:`CheckResult`, its four verdicts, the tolerances of
"exact", and how an exception becomes a verdict (a refusal or a failure) and a one-line reason."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "EXACT",
    "FAIL",
    "GRAD_RTOL",
    "LOGITS_ATOL",
    "NOT_APPLICABLE",
    "REFUSED",
    "STATUSES",
    "CheckResult",
    "describe_error",
    "is_refusal",
    "shorten",
]

#: Tolerances of the issue's definition of "exact" (fp32).
LOGITS_ATOL = 1e-4
GRAD_RTOL = 1e-4

EXACT, REFUSED, FAIL, NOT_APPLICABLE = "exact", "refused", "FAIL", "n/a"
STATUSES = (EXACT, REFUSED, FAIL, NOT_APPLICABLE)


@dataclass
class CheckResult:
    """Outcome of one architecture's check.

    Attributes:
        model: the model type or path checked.
        status: ``exact`` / ``refused`` / ``FAIL`` / ``n/a``.
        reason: the refusal message, the failure, or why it does not apply.
        logits_err: worst max-abs logits difference over the packed variants that ran.
        grad_err: worst relative gradient difference over the packed variants that ran.
        generate: ``equal``, ``different``, ``refused``, ``n/a (...)`` or ``not run``.
        variants: per packed variant, ``ok`` / ``refused: ...`` / ``FAIL ...`` / ``skipped: ...``.
        cp_size: ranks of the collator variant.
        ulysses_size: the collator variant's head-parallel size (1: the sequence layout only).
        seconds: wall time of the check.
        transformers: the transformers version the check ran with.
    """

    model: str
    status: str = EXACT
    reason: str = ""
    logits_err: float | None = None
    grad_err: float | None = None
    generate: str = "not run"
    variants: dict[str, str] = field(default_factory=dict)
    cp_size: int = 1
    ulysses_size: int = 1
    seconds: float = 0.0
    transformers: str = ""

    def line(self) -> str:
        """One human-readable line: verdict (reason) | numbers | cp_size | seconds."""
        nums = []
        if self.logits_err is not None:
            nums.append(f"logits {self.logits_err:.1e}")
        if self.grad_err is not None:
            nums.append(f"grads {self.grad_err:.1e}")
        # generate() runs one unpacked sequence: "equal" there says nothing about the packed verdict before it.
        nums.append(f"unpacked generate() {self.generate}")
        head = f"{self.model}: {self.status}" + (f" ({self.reason})" if self.reason else "")
        ulysses = f", ulysses_size={self.ulysses_size}" if self.ulysses_size > 1 else ""
        return f"{head} | {', '.join(nums)} | cp_size={self.cp_size}{ulysses} | {self.seconds:.1f} s"


def shorten(text: str, limit: int) -> str:
    """``text`` on one line, cut at a word boundary with ``...`` if it is longer than ``limit`` characters
    (a reason is never cut mid-word)."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 3]
    space = cut.rfind(" ")
    if space > limit // 2:  # one very long word (a path) is cut where it must be
        cut = cut[:space]
    return cut.rstrip(" ,;:") + "..."


def describe_error(err: BaseException, limit: int = 1000) -> str:
    """``TypeName: message`` of ``err`` on one line, at most ``limit`` characters (cut between words)."""
    return shorten(f"{type(err).__name__}: {err}", limit)


def is_refusal(err: BaseException) -> bool:
    """Whether ``err`` (or an exception it was raised from) is a ``NotImplementedError``: the package
    refused to compute something it cannot compute exactly."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, NotImplementedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
