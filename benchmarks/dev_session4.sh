#!/usr/bin/env bash
# Session 4's last device call: GPU tests of the GEMV-norm fusion, PDL and chunk graphs;
# W4 with the norm fusion on/off; W2 (server) with chunk graphs; W1; W1-small; gpu_check.
set -uo pipefail
source benchmarks/device_env.sh
{
step timeout 240 python -m pytest tests/kernels/test_gemv.py tests/kernels/test_pdl.py tests/e2e/test_cuda_graphs.py -m gpu -q -p no:cacheprovider -rA
step python -m pagedllm bench latency --dummy llama3-8b --output-json "$OUT/w4.json"
PAGEDLLM_GEMV_NORM=0 step python -m pagedllm bench latency --dummy llama3-8b --output-json "$OUT/w4_nonorm.json"
bash benchmarks/w2_suite.sh
step python -m pagedllm bench throughput --workload W1 --dummy llama3-8b --no-hf --max-num-batched-tokens 8192 --output-json "$OUT/w1.json"
step python -m pagedllm bench throughput --workload W1-small --dummy smollm2-135m --no-hf --max-num-batched-tokens 8192 --output-json "$OUT/w1s.json"
step python -m pagedllm bench latency --dummy llama3-8b --output-json "$OUT/w4b.json"
step python benchmarks/gpu_check.py
} 2>&1 | grep -v "torch_dtype" | tee "$OUT/log.txt"
