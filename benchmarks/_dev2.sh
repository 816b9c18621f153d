source benchmarks/device_env.sh
python -c "import torch; print(torch.__version__)"
step timeout 200 python -m pytest tests/kernels/test_gemv_rope.py tests/kernels/test_paged_attention.py tests/kernels/test_pdl.py -m gpu -q -p no:cacheprovider -x -k "not test_gpu_grid" 2>&1 | tail -5
step timeout 200 python -m pytest tests/kernels/test_gemv_rope.py -q -p no:cacheprovider 2>&1 | tail -3
step timeout 240 python -m pytest tests/e2e/test_cuda_graphs.py -m gpu -q -p no:cacheprovider 2>&1 | tail -3
step python benchmarks/gpu_check.py 2>&1 | tail -8
for i in 1 2; do
  echo "--- new"; python -m pagedllm bench latency --dummy llama3-8b 2>&1 | grep -E "TTFT|TPOT"
  echo "--- old (805b458)"; PYTHONPATH=/tmp/site:.old python -m pagedllm bench latency --dummy llama3-8b 2>&1 | grep -E "TTFT|TPOT"
done
echo "--- bytecode experiment"
python -c "import torch, os, transformers, sympy; [print(m.__name__, os.path.exists(os.path.join(os.path.dirname(m.__file__), '__pycache__'))) for m in (torch, transformers, sympy)]"
CFG="from pagedllm.config import EngineArgs; from pagedllm.benchmarks.workloads import write_dummy_model as w; EngineArgs(model=w('llama3-8b'), load_format='dummy', skip_tokenizer_init=True).create_engine_config()"
for i in 1 2; do
/usr/bin/time -f "import torch %e s" python -c "import torch"
/usr/bin/time -f "torch+config %e s" python -c "$CFG"
done
SP=$(python -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
echo "site-packages: $SP"
/usr/bin/time -f "compileall torch sympy transformers -j16: %e s" env PYTHONPYCACHEPREFIX=/tmp/pyc python -m compileall -q -j 16 -x 'transformers/models/(?!auto|llama)' $SP/torch $SP/sympy $SP/transformers > /dev/null 2>&1
du -sh /tmp/pyc
for i in 1 2; do
PYTHONPYCACHEPREFIX=/tmp/pyc /usr/bin/time -f "with pyc: import torch %e s" python -c "import torch"
PYTHONPYCACHEPREFIX=/tmp/pyc /usr/bin/time -f "with pyc: torch+config %e s" python -c "$CFG"
done
python -X importtime -c "$CFG" 2> /tmp/imp.txt; sort -t'|' -k2 -n /tmp/imp.txt | tail -12
grep -c import /tmp/imp.txt
