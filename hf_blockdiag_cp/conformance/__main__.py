"""``python -m hf_blockdiag_cp.conformance``: the conformance check's command (the README's; also
``hf-blockdiag-cp-check``, and ``python -m hf_blockdiag_cp.check``, its earlier name)."""

from .cli import main

if __name__ == "__main__":  # not in the CP ranks, which re-import the main module under another name
    raise SystemExit(main())
