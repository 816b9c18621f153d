#!/usr/bin/env bash
# One device call: the fused gate_up + SiLU GEMM (kernels/gemm_silu.py) -- its GPU tests,
# the plan sweep against cuBLAS + silu_mul (benchmarks/gemm_silu_ab.py), then W1 with the
# fused kernel off and on (the sweep's best plan at 512 rows, or PLAN=...), alternating,
# in the same lease.  Results under $OUT.
# Usage (on the GPU machine, repo root; .whl carried): bash benchmarks/gemm_silu_suite.sh
# SKIP_TESTS=1 skips the tests; SKIP_SWEEP=1 the sweep; REPEATS=N W1 pairs (default 2).
set -uo pipefail
source benchmarks/device_env.sh
{
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
[ -z "${SKIP_TESTS:-}" ] && step timeout 200 python -m pytest tests/kernels/test_gemm_silu.py \
  -q -rf -p no:cacheprovider
if [ -z "${SKIP_SWEEP:-}" ]; then
  step timeout 300 python benchmarks/gemm_silu_ab.py --out "$OUT/gemm_silu.json"
fi
PLAN=${PLAN:-$(python -c "import json; print(json.load(open('$OUT/gemm_silu.json'))['best_plan'].get('512', ''))" 2>/dev/null)}
echo "fused plan for W1: ${PLAN:-default}"
W1="python -m pagedllm bench throughput --workload W1 --dummy llama3-8b --no-hf --scheduling-policy throughput"
for i in $(seq "${REPEATS:-2}"); do
  PAGEDLLM_GATE_UP_SILU=0 step $W1 --output-json "$OUT/w1_unfused_$i.json"
  PAGEDLLM_GATE_UP_SILU_PLAN=$PLAN step $W1 --output-json "$OUT/w1_fused_$i.json"
done
} 2>&1 | tee "$OUT/suite.log"
for f in "$OUT"/w1_*.json; do echo "$(basename "$f") $(grep -o '"pagedllm_out_tok_s": [0-9.]*' "$f")"; done
