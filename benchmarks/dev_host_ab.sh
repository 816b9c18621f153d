#!/usr/bin/env bash
# One device call (session 4): host/NUMA layout, the prefill's host profile, W4 with the
# GEMV prefetch depth 1/2/4 (PAGEDLLM_GEMV_PREFETCH) and W4 pinned to either CPU half.
set -uo pipefail
source benchmarks/device_env.sh
{
lscpu | grep -E "Model name|Socket|NUMA|^CPU\(s\)|MHz"
nvidia-smi topo -m
for p in 2 4; do PAGEDLLM_GEMV_PREFETCH=$p step timeout 120 python -m pytest tests/kernels/test_gemv.py -m gpu -q -p no:cacheprovider; done
step python benchmarks/ttft_probe.py --trials 6 --cprofile --out "$OUT"
for p in 1 2 4; do
  PAGEDLLM_GEMV_PREFETCH=$p step python -m pagedllm bench latency --dummy llama3-8b --output-json "$OUT/w4_pre$p.json"
done
step taskset -c 0-7 python -m pagedllm bench latency --dummy llama3-8b --output-json "$OUT/w4_cpu0.json"
step taskset -c 8-15 python -m pagedllm bench latency --dummy llama3-8b --output-json "$OUT/w4_cpu8.json"
} 2>&1 | grep -v "INFO\|torch_dtype" | tee "$OUT/log.txt"
