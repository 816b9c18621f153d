#!/usr/bin/env bash
# W2 on the GPU machine: the OpenAI server on the Llama-3-8B shape with dummy weights,
# loaded by `pagedllm bench serve` at 10, 20 and 40 req/s (400 requests each, W1's
# generator, token-id prompts).  Also times process start -> /health OK.  Results under $OUT.
# Usage (repo root; fastapi/uvicorn/pydantic/pyzmq wheels in .whl): bash benchmarks/w2_suite.sh
set -uo pipefail
source benchmarks/device_env.sh
PORT=8765
M=$(python -c "from pagedllm.benchmarks.workloads import write_dummy_model as w; print(w('llama3-8b'))")
{
t0=$(date +%s.%N)
python -m pagedllm serve --model "$M" --load-format dummy --skip-tokenizer-init \
  --port $PORT > "$OUT/server.log" 2>&1 &
SP=$!
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 $SP 2>/dev/null || { echo "server exited"; cat "$OUT/server.log"; exit 1; }
  sleep 0.2
done
echo "ready to serve in $(python -c "import time; print(round(time.time() - $t0, 1))") s"
for r in ${RATES:-10 20 40}; do
  step python -m pagedllm bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts 400 \
    --request-rate "$r" --output-json "$OUT/w2_rate$r.json"
done
kill $SP; wait $SP
tail -5 "$OUT/server.log"
} 2>&1 | tee "$OUT/w2.log"
