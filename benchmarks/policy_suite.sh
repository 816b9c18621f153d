#!/usr/bin/env bash
# One device call: W1 (and W1-small) under FCFS and under the throughput scheduling
# policy in the same lease, then a per-step kernel profile of W1 under the throughput
# policy (PDL off, so kernel durations exclude PDL waits).  Results under $OUT.
# Usage (on the GPU machine, repo root; .whl carried): bash benchmarks/policy_suite.sh
set -uo pipefail
source benchmarks/device_env.sh
{
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
for pol in fcfs throughput; do
  step python -m pagedllm bench throughput --workload W1 --dummy llama3-8b --no-hf \
    --scheduling-policy "$pol" --output-json "$OUT/w1_$pol.json"
done
step python -m pagedllm bench throughput --workload W1-small --dummy smollm2-135m --no-hf \
  --scheduling-policy throughput --output-json "$OUT/w1small_throughput.json"
PAGEDLLM_PDL=0 step python benchmarks/profile_step.py --dummy llama3-8b --num-prompts 256 \
  --no-cprofile --per-step --scheduling-policy throughput --out /tmp
cp /tmp/steps.jsonl "$OUT/steps_throughput.jsonl" 2>/dev/null
} 2>&1 | tee "$OUT/suite.log"
