#!/usr/bin/env bash
# W2 on the GPU machine: the OpenAI server on the Llama-3-8B shape with dummy weights,
# loaded by `pagedllm bench serve` at 10, 20 and 40 req/s (400 requests each, W1's
# generator, token-id prompts).
#
# W2 sends the same prompts at every rate, so the protocol matters:
# * default: a fresh server per rate -- every prompt is computed (a cold prefix cache);
# * SAME_SERVER=1: one server for all rates, in order -- from the second rate on, the
#   prompts are served from the prefix cache, as in any benchmark that does not restart
#   the server between rates (prefix caching is on by default, in vLLM too).
#
# SERVE_ARGS adds engine flags to the server (e.g. SERVE_ARGS="--max-cudagraph-capture-size
# 4096" TAG=g4k_ for an A/B in the same lease).
#
# Also times each start -> /health OK, records the engine core's step trace
# (PAGEDLLM_STEP_TRACE) and the CPU time of the API and core processes per rate, and
# splits the slowest first tokens (benchmarks/w2_tail.py).  Results under $OUT.
# Usage (repo root; fastapi/uvicorn/pydantic/pyzmq wheels in .whl, with fastapi 0.165's
# opentelemetry-api and anyio's sniffio, which the device lacks):
#   [SAME_SERVER=1] [RATES="20"] bash benchmarks/w2_suite.sh
set -uo pipefail
source benchmarks/device_env.sh
PORT=8765
TAG=${TAG:-}${SAME_SERVER:+same_}
M=$(python -c "from pagedllm.benchmarks.workloads import write_dummy_model as w; print(w('llama3-8b'))")
cpu() { awk '{printf "%.2f", ($14 + $15) / 100}' "/proc/$1/stat"; }
start_server() {  # $1: name for the log and trace files
  local t0; t0=$(date +%s.%N)
  PAGEDLLM_STEP_TRACE="$OUT/${TAG}trace_$1.jsonl" python -m pagedllm serve --model "$M" \
    --load-format dummy --skip-tokenizer-init --port $PORT --disable-uvicorn-access-log \
    ${SERVE_ARGS:-} \
    > "$OUT/${TAG}server_$1.log" 2>&1 &
  SP=$!
  wait_healthy $PORT $SP "$OUT/${TAG}server_$1.log" "$t0"
  echo "(started $(date -d @"$t0" +%T.%N))"
  grep -E "engine core process started|loaded|captured|engine ready|Serving on" \
    "$OUT/${TAG}server_$1.log"
  CORE=$(pgrep -P $SP -f spawn_main | head -1)
  TRACE="$OUT/${TAG}trace_$1.jsonl"
}
{
[ -n "${SAME_SERVER:-}" ] && start_server all
for r in ${RATES:-10 20 40}; do
  [ -z "${SAME_SERVER:-}" ] && start_server "rate$r"
  a=$(cpu $SP); c=$(cpu "$CORE"); t=$SECONDS
  step python -m pagedllm bench serve --base-url "http://127.0.0.1:$PORT" --num-prompts 400 \
    --request-rate "$r" --save-detailed --output-json "$OUT/${TAG}w2_rate$r.json"
  echo "rate $r: API process CPU $(python -c "print(round($(cpu $SP) - $a, 1))") s," \
    "engine core CPU $(python -c "print(round($(cpu "$CORE") - $c, 1))") s, over $((SECONDS - t)) s"
  python benchmarks/w2_tail.py "$OUT/${TAG}w2_rate$r.json" "$TRACE"
  [ -z "${SAME_SERVER:-}" ] && { kill $SP; wait $SP; }
done
[ -n "${SAME_SERVER:-}" ] && { kill $SP; wait $SP; }
} 2>&1 | tee "$OUT/${TAG}w2.log"
