#!/usr/bin/env bash
# One device call: GPU correctness of the mixed-batch attention kernel and the CUDA
# graphs, then W1 under FCFS and under the throughput scheduling policy in the same lease
# (and the throughput policy with PAGEDLLM_ATTN_TWO_LAUNCHES=1, the previous mixed-batch
# attention), W4, W1-small, and a per-step kernel profile of W1 under the throughput
# policy (PDL off, so kernel durations exclude PDL waits).  Results under $OUT.
# Usage (on the GPU machine, repo root; .whl carried): bash benchmarks/policy_suite.sh
# SKIP_TESTS=1 skips the correctness part; GPU_CHECK=1 adds benchmarks/gpu_check.py; TEST_K picks the attention tests (-k);
# TWO_LAUNCH_AB=1 runs the second throughput-policy W1 with the two-launch attention.
set -uo pipefail
source benchmarks/device_env.sh
{
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
if [ -z "${SKIP_TESTS:-}" ]; then
  step timeout 200 python -m pytest tests/kernels/test_paged_attention.py -q -rf \
    -p no:cacheprovider -k "${TEST_K:-not test_gpu_grid}"
  step timeout 150 python -m pytest tests/e2e/test_cuda_graphs.py -q -rf -p no:cacheprovider
fi
[ -n "${GPU_CHECK:-}" ] && step timeout 150 python benchmarks/gpu_check.py
W1="python -m pagedllm bench throughput --workload W1 --dummy llama3-8b --no-hf"
step $W1 --scheduling-policy fcfs --output-json "$OUT/w1_fcfs.json"
step $W1 --scheduling-policy throughput --output-json "$OUT/w1_throughput.json"
if [ -n "${TWO_LAUNCH_AB:-}" ]; then
  PAGEDLLM_ATTN_TWO_LAUNCHES=1 step $W1 --scheduling-policy throughput \
    --output-json "$OUT/w1_throughput_2launch.json"
else
  step $W1 --scheduling-policy throughput --output-json "$OUT/w1_throughput_b.json"
fi
step python -m pagedllm bench latency --dummy llama3-8b --output-json "$OUT/w4.json"
step python -m pagedllm bench throughput --workload W1-small --dummy smollm2-135m --no-hf \
  --scheduling-policy throughput --output-json "$OUT/w1small_throughput.json"
PAGEDLLM_PDL=0 step python benchmarks/profile_step.py --dummy llama3-8b --num-prompts 256 \
  --no-cprofile --per-step --scheduling-policy throughput --out /tmp
cp /tmp/steps.jsonl "$OUT/steps_throughput.jsonl" 2>/dev/null
} 2>&1 | tee "$OUT/suite.log"
for f in "$OUT"/*.json; do echo "$(basename "$f") $(grep -o '"pagedllm_out_tok_s": [0-9.]*\|"tpot_ms[^,]*\|"ttft_ms[^,]*' "$f" | tr '\n' ' ')"; done
