source benchmarks/device_env.sh
bash benchmarks/startup_probe.sh 2 2>&1 | grep -E "ready to serve|imported|built|loaded|memory plan|Triton:|engine ready|warm-up" | sed 's/INFO 2026-11-29 //'
step timeout 200 python -m pytest tests/kernels/test_paged_attention.py tests/kernels/test_elementwise.py tests/kernels/test_pdl.py tests/kernels/test_gemv.py tests/kernels/test_gemv_rope.py -q -p no:cacheprovider -rf -k "not test_gpu_grid" 2>&1 | grep -E "FAILED|passed|failed|Error" | head
step timeout 150 python -m pytest tests/e2e/test_cuda_graphs.py -m gpu -q -p no:cacheprovider 2>&1 | tail -1
step python benchmarks/gpu_check.py 2>&1 | tail -3
for i in 1 2; do
  echo "--- new"; python -m pagedllm bench latency --dummy llama3-8b 2>&1 | grep -E "TTFT|TPOT"
  echo "--- old (805b458)"; (cd .old && PYTHONPATH=/tmp/site:. python -c "import pagedllm, sys; print(pagedllm.__file__)" && PYTHONPATH=/tmp/site:. python -m pagedllm bench latency --dummy llama3-8b 2>&1 | grep -E "TTFT|TPOT")
done
step python -m pagedllm bench throughput --workload W1 --dummy llama3-8b --no-hf --max-num-batched-tokens 8192 2>&1 | tail -4
