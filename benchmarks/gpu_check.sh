#!/usr/bin/env bash
# The one prepared check for a lent GPU machine (docs/gpu.md), from the repository root:
#   bash benchmarks/gpu_check.sh [--world N] [--only NAMES]    # table in $OUT/gpu_check.md and .json
# Versions first: a torch older than the one constraints.txt pins stops here (exit 3), before any check;
# then every check (benchmarks/gpu_check.py), within 8 minutes on one GPU and 10 on more. Uses the
# machine's python3 (its own CUDA torch) with src/ on PYTHONPATH: nothing is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
export OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
echo "gpu_check: ${gpus:-0} GPU(s) listed by nvidia-smi"
$PY benchmarks/gpu_check.py --gate || exit $?
# the driver keeps within its budget (420 s on one device, 540 s on more); this is the backstop
limit=$(( ${gpus:-0} > 1 ? 590 : 470 ))
timeout "$limit" $PY benchmarks/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
