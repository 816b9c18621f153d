#!/usr/bin/env bash
# One device call: GPU tests, then W4, W1 and W1-small on an H200 with dummy weights.
# Usage (on the GPU machine, repo root): bash benchmarks/gpu_suite.sh [quick]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
step() { echo "=== $*"; local t=$SECONDS; "$@"; echo "=== rc=$? in $((SECONDS - t)) s"; }
step python benchmarks/gpu_check.py 2>&1 | tee "$OUT/check.log"
step python -m pagedllm bench latency --dummy llama3-8b --output-json "$OUT/w4.json" 2>&1 | tee "$OUT/w4.log"
step python -m pagedllm bench throughput --workload W1 --dummy llama3-8b --no-hf \
  --max-num-batched-tokens 8192 --output-json "$OUT/w1.json" 2>&1 | tee "$OUT/w1.log"
step python -m pagedllm bench throughput --workload W1-small --dummy smollm2-135m --no-hf \
  --max-num-batched-tokens 8192 --output-json "$OUT/w1small.json" 2>&1 | tee "$OUT/w1small.log"
