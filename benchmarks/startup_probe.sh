#!/usr/bin/env bash
# Start -> first /health 200 of `pagedllm serve` (Llama-3-8B shape, dummy weights), with
# the engine core's start-up phases and Triton's compile count from the server log.
# The first run on a fresh machine is the cold start (empty Triton cache, cold page
# cache); later runs show the warm start.  Usage (repo root): bash benchmarks/startup_probe.sh [N]
set -uo pipefail
source benchmarks/device_env.sh
PORT=8766
M=$(python -c "from pagedllm.benchmarks.workloads import write_dummy_model as w; print(w('llama3-8b'))")
for i in $(seq "${1:-1}"); do
  t0=$(date +%s.%N)
  python -m pagedllm serve --model "$M" --load-format dummy --skip-tokenizer-init \
    --port $PORT --disable-uvicorn-access-log > "$OUT/startup_$i.log" 2>&1 &
  SP=$!
  echo -n "start $i: "; wait_healthy $PORT $SP "$OUT/startup_$i.log" "$t0"
  grep -E "process started|imported|built the engine|loaded|memory plan|captured|Triton:|engine ready|Serving on" \
    "$OUT/startup_$i.log"
  kill $SP; wait $SP
done
