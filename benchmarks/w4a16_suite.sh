#!/usr/bin/env bash
# Issue 21 on the GPU: the W4A16 kernel sweep, then end to end (TPOT and W1) with the
# configurations it picked, and W8A8-INT8.  Two device calls (each < 10 min):
#   bash benchmarks/w4a16_suite.sh sweep   # ~4 min: correctness + timings -> $OUT
#   bash benchmarks/w4a16_suite.sh e2e     # latency + W1 of w4a16 (tuned), w8a8 latency
#   bash benchmarks/w4a16_suite.sh tc      # ~6 min: GPU tests, the tensor-core W4A16
#                                          # GEMM's sweep (kernels/wna16_tc.py), W1 with
#                                          # its table (TC_BUDGET_S, default 150)
# e2e uses $WNA16_TABLE, else ./wna16_configs.json (copy the sweep's table into the repo
# root: untracked files travel), else /tmp/wna16_configs.json (a still-warm machine),
# else the built-in defaults.
set -uo pipefail
source benchmarks/device_env.sh
what=${1:-sweep}
if [ "$what" = sweep ]; then
  step python benchmarks/wna16_sweep.py --out "$OUT/wna16_sweep.json" \
    --table "$OUT/wna16_configs.json" --budget-s 200
  cp "$OUT/wna16_configs.json" /tmp/wna16_configs.json 2>/dev/null
fi
if [ "$what" = e2e ]; then
  table=${WNA16_TABLE:-}
  for t in ./wna16_configs.json /tmp/wna16_configs.json; do
    [ -z "$table" ] && [ -f "$t" ] && table=$t
  done
  if [ -n "$table" ]; then export PAGEDLLM_WNA16_CONFIGS=$table; fi
  echo "PAGEDLLM_WNA16_CONFIGS=${PAGEDLLM_WNA16_CONFIGS:-<defaults>}"
  step python -m pagedllm bench latency --dummy llama3-8b-w4a16 \
    --output-json "$OUT/lat_w4a16.json" 2>&1 | grep -v INFO | tail -8
  step python -m pagedllm bench throughput --workload W1 --dummy llama3-8b-w4a16 --no-hf \
    --output-json "$OUT/w1_w4a16.json" 2>&1 | grep -v "INFO.*step" | tail -8
  step python -m pagedllm bench latency --dummy llama3-8b-w8a8-int8 \
    --output-json "$OUT/lat_w8a8.json" 2>&1 | grep -v INFO | tail -8
fi
if [ "$what" = tc ]; then
  # GPU check of the default routing (no table: striped / dequantise paths), then the
  # sweep (only checked configurations are timed or written), then the
  # routing test again and W1 with the table -- or without one if the sweep wrote none.
  unset PAGEDLLM_WNA16_TC_CONFIGS
  step python -m pytest -q -x -p no:cacheprovider tests/kernels/test_wna16_tc.py \
    -k gpu_default_routing 2>&1 | tail -5
  table=$OUT/wna16_tc_$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr " " "_").json
  step python benchmarks/wna16_tc_sweep.py --out "$OUT/wna16_tc_sweep.json" \
    --table "$table" --budget-s "${TC_BUDGET_S:-150}" 2>&1 | grep -v "^check FAILED" \
    | tail -40
  [ -s "$OUT/wna16_tc_sweep.json" ] && python - "$OUT/wna16_tc_sweep.json" <<'PY'
import collections, json, sys
r = json.load(open(sys.argv[1]))
c = collections.Counter((f["proj"], f["M"], f.get("error", "wrong")[:40]) for f in r["check_failed"])
print("check failures (proj, M, why): count"); [print(" ", k, v) for k, v in sorted(c.items())]
for f in r["check_failed"][:12]:
    print("  e.g.", f["proj"], f["M"], f["config"], f.get("err"), f.get("same_bits"), f.get("error"))
PY
  if [ -s "$table" ]; then
    cp "$table" /tmp/wna16_tc_configs.json
    export PAGEDLLM_WNA16_TC_CONFIGS=$table
    step python -m pytest -q -x -p no:cacheprovider tests/kernels/test_wna16_tc.py \
      -k gpu_default_routing 2>&1 | tail -5
  else
    echo "no table written: W1 on the default (striped / dequantise) paths"
  fi
  echo "PAGEDLLM_WNA16_TC_CONFIGS=${PAGEDLLM_WNA16_TC_CONFIGS:-<none>}"
  step python -m pagedllm bench throughput --workload W1 --dummy llama3-8b-w4a16 --no-hf \
    --output-json "$OUT/w1_w4a16_tc.json" 2>&1 | grep -v "INFO.*step" | tail -8
fi
