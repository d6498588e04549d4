#!/usr/bin/env bash
# The device checks to run when a GPU machine is lent (device tool, one call), from the repository root:
#   bash benchmarks/gpu_check.sh            # writes $OUT/gpu_check.log when $OUT is set
# Every strategy verified against one process and sharded generation (benchmarks/gpu_check.py),
# then the overhead and generation benchmarks. Uses the machine's python3 (its own CUDA torch) with
# the source tree on PYTHONPATH: nothing is installed. Never run on CUDA yet (no GPU lent so far).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
LOG=${OUT:-/tmp}/gpu_check.log
{
  nvidia-smi -L || echo "no nvidia-smi"
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.device_count())"
  status=0
  timeout 300 $PY benchmarks/gpu_check.py || status=1
  timeout 120 $PY benchmarks/apply_overhead.py --steps 30 || status=1
  timeout 120 $PY benchmarks/generate.py --meshes "tp=1" --prompts 128,2048 --new 32 --rounds 2 || status=1
  echo "gpu_check: exit $status"
  exit $status
} 2>&1 | tee "$LOG"
