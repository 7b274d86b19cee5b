"""Every exception this package raises of its own, in one module, under one base: :class:`BlockDiagCPError`.

Each also keeps the built-in base it always had (``NotImplementedError``, ``ValueError``, ``RuntimeError``), so
``except NotImplementedError`` (a refusal), ``except ValueError`` and ``except RuntimeError`` still catch them.
Every refusal (the package will not compute something it cannot compute exactly) is a :class:`Refusal`, both a
``BlockDiagCPError`` and a ``NotImplementedError``; the package raises no bare ``NotImplementedError``
(``tests/package/test_refusal_root.py`` walks its raises).
The modules that raise them import them from here (and so still export them under their old paths).
"""

from __future__ import annotations

__all__ = [
    "BlockDiagCPError",
    "AgreementError",
    "BackendUnavailable",
    "CPKernelError",
    "CollectiveError",
    "ExchangeSizeError",
    "MaskConsumedError",
    "ParameterMismatchError",
    "PlanError",
    "Refusal",
    "UnsupportedModel",
]


class BlockDiagCPError(Exception):
    """Base of every exception hf_blockdiag_cp raises of its own (``except BlockDiagCPError`` catches them all)."""


class Refusal(BlockDiagCPError, NotImplementedError):
    """The package refuses to compute something it cannot compute exactly (a model, a keyword, a layout, a loss);
    the message names the cause and the fix. The root of every refusal: the more specific ones below subclass it."""


class AgreementError(BlockDiagCPError, RuntimeError):
    """CP ranks disagree about the step (different data, plans or topology); raised on every rank alike."""


class BackendUnavailable(Refusal):
    """The requested backend cannot compute this call exactly (raised instead of computing something else)."""


class CPKernelError(BlockDiagCPError, RuntimeError):
    """An attention kernel raised on this rank during a CP step (its peers will fail in their next
    collective, within ``collective_timeout_s``). The CP group is recorded as broken: its next use on this
    rank raises :class:`~hf_blockdiag_cp.distributed.CollectiveError` instead of entering a collective
    its peers left."""


class CollectiveError(BlockDiagCPError, RuntimeError):
    """A collective of the CP group failed or timed out (usually: a peer rank failed first).

    The group is unusable afterwards: every later collective of this package on it raises this error
    again at once. Catching it and going on cannot work; end the job and restart it (e.g. from the
    last checkpoint)."""


class ExchangeSizeError(BlockDiagCPError, ValueError):
    """A K/V message does not have the size the plan gives its receiver (raised before it is sent)."""


class MaskConsumedError(Refusal):
    """Model code used the attention mask itself (outside the attention function)."""


class ParameterMismatchError(BlockDiagCPError, RuntimeError):
    """The ranks of a CP group hold different parameters (raised on every rank alike)."""


class PlanError(BlockDiagCPError, ValueError):
    """A plan (or the metadata it was built from) is inconsistent; raised on the host, before any kernel."""


class UnsupportedModel(Refusal):
    """The model cannot be computed exactly by blockdiag_cp for this batch (raised instead of computing
    something else)."""
