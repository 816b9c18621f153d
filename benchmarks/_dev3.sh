source benchmarks/device_env.sh
step timeout 200 python -m pytest tests/kernels/test_gemv_rope.py -q -p no:cacheprovider --tb=short 2>&1 | grep -E "Mismatch|Greatest|passed|failed|Error" | head -20
step timeout 300 python -m pytest tests/kernels/test_paged_attention.py tests/kernels/test_elementwise.py tests/kernels/test_pdl.py tests/kernels/test_gemv.py -q -p no:cacheprovider -x -k "not test_gpu_grid" 2>&1 | tail -3
step timeout 240 python -m pytest tests/e2e/test_cuda_graphs.py -m gpu -q -p no:cacheprovider 2>&1 | tail -3
step python benchmarks/gpu_check.py 2>&1 | tail -4
for i in 1 2; do
  echo "--- new"; python -m pagedllm bench latency --dummy llama3-8b 2>&1 | grep -E "TTFT|TPOT"
  echo "--- old (805b458)"; PYTHONPATH=/tmp/site:.old python -m pagedllm bench latency --dummy llama3-8b 2>&1 | grep -E "TTFT|TPOT"
done
echo "--- config build"
CFG="from pagedllm.config import EngineArgs; from pagedllm.benchmarks.workloads import write_dummy_model as w; EngineArgs(model=w('llama3-8b'), load_format='dummy', skip_tokenizer_init=True).create_engine_config()"
python -X importtime -c "$CFG" 2> /tmp/imp.txt
python - <<'PY'
rows = []
for line in open("/tmp/imp.txt"):
    if not line.startswith("import time:") or "cumulative" in line: continue
    parts = line.split("|")
    cum = int(parts[1]); name = parts[2].rstrip("\n")
    if not name.startswith("  ") and name.strip():
        rows.append((cum, name.strip()))
rows.sort(reverse=True)
print("top-level imports by cumulative ms:", [(n, c // 1000) for c, n in rows[:14]])
PY
for i in 1 2; do
/usr/bin/time -f "config %e s" python -c "$CFG"
/usr/bin/time -f "config, torchvision hidden %e s" python -c "import sys; sys.modules['torchvision'] = None; $CFG"
done
