#!/usr/bin/env bash
# Same-lease A/B on the GPU machine, interleaved: W1 (2 repeats per process), W4, W1-small.
#   "new": this tree, with the engine flags in $A_ARGS;
#   "old": an older copy of the package in .old/pagedllm (e.g. `git archive <rev>
#          pagedllm | tar -x -C .old`), or with AB_SAME_TREE=1 this tree again, with the
#          engine flags in $B_ARGS -- e.g. to A/B one flag:
#          A_ARGS="--max-cudagraph-capture-size 8192" AB_SAME_TREE=1 bash benchmarks/ab_suite.sh 2
# Results under $OUT/ab_*.json and a summary on stdout.
# Usage (repo root): bash benchmarks/ab_suite.sh [ROUNDS]
set -uo pipefail
source benchmarks/device_env.sh
[ -n "${AB_SAME_TREE:-}" ] || [ -d .old/pagedllm ] || { echo ".old/pagedllm missing"; exit 1; }
run() {  # run new|old ARGS...: the old copy runs from inside .old (cwd first on sys.path)
  local who=$1; shift
  if [ "$who" = new ]; then
    python -m pagedllm "$@" ${A_ARGS:-}
  elif [ -n "${AB_SAME_TREE:-}" ]; then
    python -m pagedllm "$@" ${B_ARGS:-}
  else
    (cd .old && PYTHONPATH=/tmp/site:. python -m pagedllm "$@" ${B_ARGS:-})
  fi
}
for r in $(seq "${1:-1}"); do
  for who in new old; do
    run $who bench throughput --workload W1 --dummy llama3-8b --no-hf --repeats 2 \
      --output-json "$OUT/ab_w1_${who}_$r.json" 2>&1 | grep -E "^W1 " | sed "s/^/$who r$r /"
    run $who bench latency --dummy llama3-8b --output-json "$OUT/ab_w4_${who}_$r.json" \
      2>&1 | grep -E "^(TTFT|TPOT)" | sed "s/^/$who r$r W4 /"
    run $who bench throughput --workload W1-small --dummy smollm2-135m --no-hf \
      --output-json "$OUT/ab_w1s_${who}_$r.json" 2>&1 | grep -E "^W1-small" | sed "s/^/$who r$r /"
  done
done
