"""``python -m hf_blockdiag_cp.conformance``: the same command line as ``python -m hf_blockdiag_cp.check``."""

from .cli import main

raise SystemExit(main())
