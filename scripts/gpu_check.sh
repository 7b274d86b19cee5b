#!/usr/bin/env bash
# One-shot check of the attention kernels on a GPU machine (< 5 minutes, no internet needed).
#
#   bash scripts/gpu_check.sh            # logs under ${OUT:-/tmp}/gpu_check/
#
# Needs Python with torch (CUDA build) and transformers; flash-attn / TransformerEngine are optional
# (their tests skip with the reason). Steps, each under its own time limit:
#   1. environment: nvidia-smi, Python / torch / CUDA / transformers / flash-attn / TE versions;
#   2. the GPU kernel tests (tests/kernels/test_gpu_kernels.py: every backend vs the float64 reference,
#      forward and backward) with pytest, or with the file's own runner when pytest is missing;
#   3. a short GPU kernel benchmark (benchmarks/bench_kernels.py --device cuda --quick).
# Exit status: 0 when the tests pass (skips allowed), 1 otherwise; the benchmark never fails the run.
set -u -o pipefail

cd "$(dirname "$0")/.."
LOG_DIR="${OUT:-/tmp}/gpu_check"
mkdir -p "$LOG_DIR"
PY="${PYTHON:-python}"
# The package is used from the source tree: no build step, no build-isolation download.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

step() { echo; echo "=== $* ($(date +%H:%M:%S))"; }

step "environment" | tee "$LOG_DIR/env.txt"
{
    nvidia-smi || echo "nvidia-smi failed"
    timeout 60 "$PY" - <<'EOF'
import importlib, platform, sys
print("python", sys.version.split()[0], platform.platform())
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-")
for name in ("transformers", "flash_attn", "transformer_engine", "pytest", "matplotlib"):
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as err:  # absent or broken: report, do not stop
        print(name, "unavailable:", type(err).__name__, str(err).splitlines()[0][:120] if str(err) else "")
import hf_blockdiag_cp
print("hf_blockdiag_cp", hf_blockdiag_cp.__version__, "from", hf_blockdiag_cp.__file__)
EOF
} 2>&1 | tee -a "$LOG_DIR/env.txt"

step "GPU kernel tests" | tee "$LOG_DIR/gpu_tests.txt"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "torch sees no CUDA device: the GPU tests would only skip; failing the check" | tee -a "$LOG_DIR/gpu_tests.txt"
    exit 1
fi
if "$PY" -c "import pytest" 2>/dev/null; then
    timeout 200 "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider tests/kernels/test_gpu_kernels.py 2>&1 \
        | tee -a "$LOG_DIR/gpu_tests.txt"
    tests_rc=${PIPESTATUS[0]}
else
    echo "pytest is not installed: running tests/kernels/test_gpu_kernels.py directly" | tee -a "$LOG_DIR/gpu_tests.txt"
    timeout 200 "$PY" tests/kernels/test_gpu_kernels.py 2>&1 | tee -a "$LOG_DIR/gpu_tests.txt"
    tests_rc=${PIPESTATUS[0]}
fi
[ "$tests_rc" = 124 ] && echo "GPU tests TIMED OUT after 200 s" | tee -a "$LOG_DIR/gpu_tests.txt"

step "GPU kernel benchmark (--quick)" | tee "$LOG_DIR/bench.txt"
timeout 120 "$PY" benchmarks/bench_kernels.py --device cuda --quick --threads 0 --out "$LOG_DIR/bench_cuda.png" 2>&1 \
    | tee -a "$LOG_DIR/bench.txt"
bench_rc=${PIPESTATUS[0]}

step "summary"
echo "tests rc=$tests_rc benchmark rc=$bench_rc; logs in $LOG_DIR"
[ "$tests_rc" = 0 ]
