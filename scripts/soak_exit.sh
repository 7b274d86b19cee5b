#!/usr/bin/env bash
# Soak test of a clean exit (issue 35, item 5): N consecutive world-4 (dp 2 x cp 2) CPTrainer runs of
# examples/trainer_packed_cp.py under torchrun, each beside a second job (a world-2 run of the same example
# in a loop, as load), counting the exit codes. A run that finished must exit 0: a rank hanging at exit is cut
# at RUN_TIMEOUT_S (counted as 124), a rank aborting at exit ("terminate called without an active exception")
# makes torchrun exit 1.
#
#   bash scripts/soak_exit.sh                 # N=30; logs and counts under ${OUT:-/tmp}/soak_exit/
#   N=5 STEPS=2 bash scripts/soak_exit.sh     # quicker
#
# Environment: N (runs, default 30), STEPS (optimizer steps per run, default 3), RUN_TIMEOUT_S (per run,
# default 300), PYTHON (default .venv/bin/python, else python), LOAD=0 (no second job).
# Exit status: 0 when all N runs exited 0, 1 otherwise. Prints "exit codes: <code>x<count> ...".
set -u -o pipefail

cd "$(dirname "$0")/.."
N="${N:-30}"
STEPS="${STEPS:-3}"
RUN_TIMEOUT_S="${RUN_TIMEOUT_S:-300}"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
LOG_DIR="${OUT:-/tmp}/soak_exit"
mkdir -p "$LOG_DIR"
rm -f "$LOG_DIR"/run*.log "$LOG_DIR"/codes.txt "$LOG_DIR"/load_codes.txt "$LOG_DIR"/stop
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
EXAMPLE=(examples/trainer_packed_cp.py --cp-size 2 --max-docs 24 --seq-len 256 --no-progress)

launch() {  # launch NPROC TIMEOUT ARGS...: torchrun's own store (--standalone), a hard time limit
    local nproc=$1 limit=$2
    shift 2
    timeout --kill-after=10 "$limit" "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$nproc" \
        "${EXAMPLE[@]}" "$@"
}

LOAD_PID=""
if [ "${LOAD:-1}" != "0" ]; then
    (
        i=0
        while [ ! -f "$LOG_DIR/stop" ]; do
            i=$((i + 1))
            launch 2 "$RUN_TIMEOUT_S" --steps $((STEPS + 3)) > "$LOG_DIR/load.log" 2>&1
            echo "load $i rc=$?" >> "$LOG_DIR/load_codes.txt"
        done
    ) &
    LOAD_PID=$!
fi

start=$(date +%s)
for i in $(seq 1 "$N"); do
    launch 4 "$RUN_TIMEOUT_S" --steps "$STEPS" > "$LOG_DIR/run$i.log" 2>&1
    rc=$?
    aborted=$(grep -c "terminate called" "$LOG_DIR/run$i.log")
    echo "run $i rc=$rc terminate=$aborted" | tee -a "$LOG_DIR/codes.txt"
done
touch "$LOG_DIR/stop"
[ -n "$LOAD_PID" ] && wait "$LOAD_PID"

echo "world-4 runs: $N in $(( $(date +%s) - start )) s (steps $STEPS, load ${LOAD:-1})"
echo "exit codes: $(sed -E 's/.*rc=([0-9]+).*/\1/' "$LOG_DIR/codes.txt" | sort | uniq -c | awk '{printf "%sx%s ", $2, $1}')"
[ -f "$LOG_DIR/load_codes.txt" ] && echo "load job exit codes: $(sed -E 's/.*rc=([0-9]+).*/\1/' \
    "$LOG_DIR/load_codes.txt" | sort | uniq -c | awk '{printf "%sx%s ", $2, $1}')"
! grep -qv "rc=0 " "$LOG_DIR/codes.txt"
