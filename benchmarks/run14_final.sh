#!/usr/bin/env bash
# Run 14's closing call: W1 on the final code (3 repeats, clocks and power logged),
# W4 too when W4=1 (run 15's closing call), W1-small, then W2 at 10 and 20 req/s on one
# server (SAME_SERVER protocol).
set -uo pipefail
source benchmarks/device_env.sh
REPEATS=3 VARIANTS="final=" bash benchmarks/env_ab.sh 1
if [ "${W4:-0}" = 1 ]; then
  python -m pagedllm bench latency --dummy llama3-8b --output-json "$OUT/w4.json" 2>&1 \
    | grep -E "TPOT|TTFT"
fi
python -m pagedllm bench throughput --workload W1-small --dummy smollm2-135m --no-hf \
  --scheduling-policy throughput --output-json "$OUT/w1small.json" 2>&1 | grep -E "^W1-small"
SAME_SERVER=1 RATES="10 20" bash benchmarks/w2_suite.sh > /dev/null 2>&1
grep -E "ready to serve|rc=" "$OUT/same_w2.log"
for f in "$OUT"/same_w2_rate*.json; do
  python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
ms = {k: f\"{d[k + '_s']['p50'] * 1e3:.1f} / {d[k + '_s']['p99'] * 1e3:.1f}\" for k in ('ttft', 'tpot')}
print(sys.argv[1].split('/')[-1], 'TTFT p50/p99', ms['ttft'], 'TPOT p50/p99', ms['tpot'],
      'ms; failed', d['failed'])" "$f"
done
