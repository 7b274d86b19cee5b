"""``python -m hf_blockdiag_cp.check``: the earlier name of ``python -m hf_blockdiag_cp.conformance``, the documented
command of the conformance check (``--help`` lists the options), kept working for scripts and docs that use it. Only
an entry point: the code, and what to import, is :mod:`hf_blockdiag_cp.conformance`."""

if __name__ == "__main__":
    from hf_blockdiag_cp.conformance.cli import main

    raise SystemExit(main())
