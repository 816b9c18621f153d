#!/usr/bin/env bash
# Run 14's check-and-measure call: GPU correctness after the padding-row mask in the
# attention kernel and the bf16 greedy path (attention kernel tests, CUDA-graph replay
# against eager, gpu_check's async / sync / eager / PDL-off agreement), W4, then W1 with
# the default code against PAGEDLLM_PDL=0 (clocks and power logged by env_ab.sh).
set -uo pipefail
source benchmarks/device_env.sh
{
step timeout 300 python -m pytest tests/kernels/test_paged_attention.py -m gpu -q -rf \
  -p no:cacheprovider
step timeout 150 python -m pytest tests/e2e/test_cuda_graphs.py -q -rf -p no:cacheprovider
step timeout 150 python benchmarks/gpu_check.py
step python -m pagedllm bench latency --dummy llama3-8b --output-json "$OUT/w4.json"
} 2>&1 | tee "$OUT/suite.log" | grep -E "passed|failed|error|identical|TPOT|TTFT|===" 
VARIANTS="base= pdl0=PAGEDLLM_PDL=0 base2=" bash benchmarks/env_ab.sh 1
