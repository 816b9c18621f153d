#!/usr/bin/env bash
# W2 on the GPU machine: the OpenAI server on the Llama-3-8B shape with dummy weights,
# loaded by `pagedllm bench serve` at 10, 20 and 40 req/s (400 requests each, W1's
# generator, token-id prompts).  A fresh server per rate: W2 sends the same prompts at
# every rate, and a warm prefix cache would serve the later rates' prompts from cache.
# Also times each start -> /health OK, records the engine core's step trace
# (PAGEDLLM_STEP_TRACE) and the CPU time of the API and core processes per rate, and
# splits the slowest first tokens (benchmarks/w2_tail.py).  Results under $OUT.
# Usage (repo root; fastapi/uvicorn/pydantic/pyzmq wheels in .whl):
#   bash benchmarks/w2_suite.sh          (RATES="20" to run one rate)
set -uo pipefail
source benchmarks/device_env.sh
PORT=8765
M=$(python -c "from pagedllm.benchmarks.workloads import write_dummy_model as w; print(w('llama3-8b'))")
cpu() { awk '{printf "%.2f", ($14 + $15) / 100}' "/proc/$1/stat"; }
{
for r in ${RATES:-10 20 40}; do
  t0=$(date +%s.%N)
  PAGEDLLM_STEP_TRACE="$OUT/trace_rate$r.jsonl" python -m pagedllm serve --model "$M" \
    --load-format dummy --skip-tokenizer-init --port $PORT > "$OUT/server_rate$r.log" 2>&1 &
  SP=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 $SP 2>/dev/null || { echo "server exited"; cat "$OUT/server_rate$r.log"; exit 1; }
    sleep 0.2
  done
  echo "ready to serve in $(python -c "import time; print(round(time.time() - $t0, 1))") s" \
    "(started $(date -d @"$t0" +%T.%N))"
  grep -E "engine core process started|loaded|captured|engine ready|Serving on" \
    "$OUT/server_rate$r.log"
  CORE=$(pgrep -P $SP -f spawn_main | head -1)
  a=$(cpu $SP); c=$(cpu "$CORE"); t=$SECONDS
  step python -m pagedllm bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts 400 \
    --request-rate "$r" --save-detailed --output-json "$OUT/w2_rate$r.json"
  echo "rate $r: API process CPU $(python -c "print(round($(cpu $SP) - $a, 1))") s," \
    "engine core CPU $(python -c "print(round($(cpu "$CORE") - $c, 1))") s, over $((SECONDS - t)) s"
  python benchmarks/w2_tail.py "$OUT/w2_rate$r.json" "$OUT/trace_rate$r.jsonl"
  kill $SP; wait $SP
done
} 2>&1 | tee "$OUT/w2.log"
