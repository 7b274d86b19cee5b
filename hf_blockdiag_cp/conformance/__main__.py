"""``python -m hf_blockdiag_cp.conformance``: the same command line as ``python -m hf_blockdiag_cp.check``."""

from .cli import main

if __name__ == "__main__":  # not in the CP ranks, which re-import the main module under another name
    raise SystemExit(main())
