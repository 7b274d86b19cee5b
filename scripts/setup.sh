#!/usr/bin/env bash
# Set up .venv for hf-blockdiag-cp: torch (CPU wheel unless one is already there), then the package
# with its test extras. Idempotent; safe to re-run.
#   TORCH_SPEC   torch requirement to install when torch is missing (default: torch==2.13.0, the CPU
#                wheel on this project's machines; elsewhere add --index-url https://download.pytorch.org/whl/cpu
#                through PIP_INDEX_URL, or preinstall the torch you want)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
.venv/bin/python -m pip install -q -e ".[test]"
.venv/bin/python -c "import torch, transformers, accelerate, hf_blockdiag_cp; print(f'hf_blockdiag_cp {hf_blockdiag_cp.__version__}: torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}')"
