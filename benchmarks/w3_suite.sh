#!/usr/bin/env bash
# W3 (shared prefix) with prefix caching on vs off, in one device call: the SmolLM2-135M
# shape on the CPU (short prefix) and Llama-3-8B (dummy weights) on the GPU.
# Usage (GPU machine, repo root): bash benchmarks/w3_suite.sh [cpu|gpu|all]
set -uo pipefail
source benchmarks/device_env.sh
what=${1:-all}
if [ "$what" != gpu ]; then
  for pc in enable no-enable; do
    step python -m pagedllm bench throughput --workload W3 --dummy smollm2-135m --device cpu \
      --num-threads 4 --num-prompts 32 --prefix-len 512 --no-hf --max-model-len 1024 \
      --kv-cache-memory-bytes 2147483648 --$pc-prefix-caching \
      --output-json "$OUT/w3cpu_$pc.json" 2>&1 | grep -v INFO | tail -5
  done
fi
if [ "$what" != cpu ]; then
  for pc in enable no-enable; do
    step python -m pagedllm bench throughput --workload W3 --dummy llama3-8b --no-hf \
      --max-num-batched-tokens 8192 --$pc-prefix-caching \
      --output-json "$OUT/w3gpu_$pc.json" 2>&1 | grep -v "INFO.*step" | tail -12
  done
fi
