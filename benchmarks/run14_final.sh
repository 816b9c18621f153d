#!/usr/bin/env bash
# Run 14's closing call: W1 on the final code (3 repeats, clocks and power logged),
# W1-small, then W2 at 10 and 20 req/s on one server (SAME_SERVER protocol).
set -uo pipefail
source benchmarks/device_env.sh
REPEATS=3 VARIANTS="final=" bash benchmarks/env_ab.sh 1
python -m pagedllm bench throughput --workload W1-small --dummy smollm2-135m --no-hf \
  --scheduling-policy throughput --output-json "$OUT/w1small.json" 2>&1 | grep -E "^W1-small"
SAME_SERVER=1 RATES="10 20" bash benchmarks/w2_suite.sh > /dev/null 2>&1
grep -E "ready to serve|rc=" "$OUT/same_w2.log"
for f in "$OUT"/same_w2_rate*.json; do
  python3 -c "
import json,sys; d=json.load(open('$f'))
print('$f'.split('/')[-1], {k: round(v, 2) for k, v in d.items() if isinstance(v, (int, float))
      and any(s in k for s in ('ttft', 'tpot', 'failed', 'output_throughput'))})"
done
