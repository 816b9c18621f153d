#!/usr/bin/env bash
# FP8 on the H200 (issue 20): PART=1: gpu-marked fp8 kernel tests (real shapes, CUDA
# graphs), then W1 and W4 for bf16 defaults, quantization=fp8, and fp8 + kv_cache_dtype=fp8;
# PART=2: W5 for the same three (and a GPU perplexity when the SmolLM2 GGUF is there).
set -uo pipefail
source benchmarks/device_env.sh
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
CONFIGS=("bf16=" "fp8=--quantization fp8" "fp8kv=--quantization fp8 --kv-cache-dtype fp8")
if [ "${PART:-1}" = 3 ]; then  # the GPU tests, then W4 fp8 and W5 for all three
  step python -m pytest -q -m gpu tests/kernels/test_fp8_kv.py tests/kernels/test_fp8_quant.py \
    2>&1 | grep -E "^E  |passed|failed" | head -8
  for c in "${CONFIGS[@]:1:1}"; do
    name=${c%%=*}; flags=${c#*=}
    step python -m pagedllm bench latency --dummy llama3-8b $flags \
      --output-json "$OUT/w4_$name.json" 2>&1 | grep -E "TPOT|TTFT|Error|error"
  done
  PART=2
fi
if [ "${PART:-1}" = 1 ]; then
  step python -m pytest -q -m gpu tests/kernels/test_fp8_kv.py tests/kernels/test_fp8_quant.py \
    2>&1 | tail -5
  for c in "${CONFIGS[@]}"; do
    name=${c%%=*}; flags=${c#*=}
    step python -m pagedllm bench throughput --workload W1 --dummy llama3-8b --no-hf $flags \
      --output-json "$OUT/w1_$name.json" > "$OUT/w1_$name.log" 2>&1
    grep -E "^W1|loaded|KV cache \(|memory plan|Error|error" "$OUT/w1_$name.log" | tail -6
    step python -m pagedllm bench latency --dummy llama3-8b $flags \
      --output-json "$OUT/w4_$name.json" 2>&1 | grep -E "TPOT|TTFT|Error|error"
  done
else
  for c in "${CONFIGS[@]}"; do
    name=${c%%=*}; flags=${c#*=}
    step python -m pagedllm bench throughput --workload W5 --dummy llama3-8b --no-hf $flags \
      --output-json "$OUT/w5_$name.json" > "$OUT/w5_$name.log" 2>&1
    grep -E "^W5|KV cache \(|Error|error" "$OUT/w5_$name.log" | tail -4
  done
fi
