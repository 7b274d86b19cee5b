"""``python -m hf_blockdiag_cp.check``: the conformance check's command line (kept at this name; the code
lives in :mod:`hf_blockdiag_cp.conformance`). ``--help`` lists the options."""

from __future__ import annotations

from .conformance import CheckResult, check_model, main, tiny_config

__all__ = ["CheckResult", "check_model", "main", "tiny_config"]

if __name__ == "__main__":
    raise SystemExit(main())
