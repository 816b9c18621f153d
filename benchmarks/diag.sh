#!/usr/bin/env bash
# One device call of diagnostics: W1 / W1-small / W4 profiles (async on), the attention
# launch-plan sweep and the GPU kernel test grid.  Results under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
step() { echo "=== $*"; local t=$SECONDS; "$@"; echo "=== rc=$? in $((SECONDS - t)) s"; }
mkdir -p "$OUT/w1" "$OUT/w4"
{
step python benchmarks/profile_step.py --dummy llama3-8b --num-prompts 256 --out "$OUT/w1"
step python benchmarks/profile_step.py --dummy llama3-8b --w4 --out "$OUT/w4"
step python benchmarks/profile_step.py --dummy smollm2-135m --num-prompts 256 --out /tmp
step timeout 200 python -m pagedllm.benchmarks.kernel_bench --sections sweep --out "$OUT/sweep.json"
step timeout 150 python -m pytest tests/kernels -m gpu -q -x -p no:cacheprovider
} 2>&1 | tee "$OUT/diag.log"
