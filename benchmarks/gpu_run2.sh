#!/usr/bin/env bash
# Device call: correctness (GPU tests, async/sync/eager agreement), then W4, W1, W1-small,
# a kernel-only W1 profile (no cProfile) and attention launch tuning.  Results under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
export PYTHONUNBUFFERED=1
step() { echo "=== $*"; local t=$SECONDS; "$@"; echo "=== rc=$? in $((SECONDS - t)) s"; }
{
step timeout 120 python -m pytest tests/kernels tests/models -m gpu -q -p no:cacheprovider
step python benchmarks/gpu_check.py
step python -m pagedllm bench latency --dummy llama3-8b --output-json "$OUT/w4.json"
step python -m pagedllm bench throughput --workload W1 --dummy llama3-8b --no-hf \
  --max-num-batched-tokens 8192 --output-json "$OUT/w1.json"
step python -m pagedllm bench throughput --workload W1-small --dummy smollm2-135m --no-hf \
  --max-num-batched-tokens 8192 --output-json "$OUT/w1small.json"
step python benchmarks/profile_step.py --dummy llama3-8b --num-prompts 256 --no-cprofile --out /tmp
step python benchmarks/profile_step.py --dummy smollm2-135m --num-prompts 256 --no-cprofile --out /tmp
step timeout 100 python benchmarks/attn_tune.py --heads 9 --kv-heads 3 --head-dim 64
step timeout 100 python benchmarks/attn_tune.py --heads 32 --kv-heads 8 --head-dim 128
} 2>&1 | tee "$OUT/run.log"
