set -uo pipefail
source benchmarks/device_env.sh
{
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv
step timeout 200 python -m pytest tests/kernels/test_pdl.py tests/kernels/test_gemv.py -m gpu -q -p no:cacheprovider
step python benchmarks/gpu_check.py
step python -m pagedllm bench latency --dummy llama3-8b --output-json "$OUT/w4.json"
PAGEDLLM_PDL=0 step python -m pagedllm bench latency --dummy llama3-8b --output-json "$OUT/w4_nopdl.json"
step python -m pagedllm bench latency --dummy llama3-8b --output-json "$OUT/w4b.json"
step python benchmarks/ttft_probe.py --out "$OUT"
step python -m pagedllm bench throughput --workload W1 --dummy llama3-8b --no-hf --max-num-batched-tokens 8192 --output-json "$OUT/w1.json"
PAGEDLLM_PDL=0 step python -m pagedllm bench throughput --workload W1 --dummy llama3-8b --no-hf --max-num-batched-tokens 8192 --output-json "$OUT/w1_nopdl.json"
step python -m pagedllm bench throughput --workload W1-small --dummy smollm2-135m --no-hf --max-num-batched-tokens 8192 --output-json "$OUT/w1s.json"
PAGEDLLM_PDL=0 step python -m pagedllm bench throughput --workload W1-small --dummy smollm2-135m --no-hf --max-num-batched-tokens 8192 --output-json "$OUT/w1s_nopdl.json"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw --format=csv
} 2>&1 | tee "$OUT/log.txt"
