#!/usr/bin/env bash
# Same-lease A/B of environment-variable variants on W1 (throughput policy), interleaved
# ROUNDS times, with the GPU's SM clock, power and throttle reasons logged by nvidia-smi
# every 200 ms (so a variant's effect on clocks shows beside its tok/s).
#   VARIANTS="base= init=PAGEDLLM_DUMMY_INIT=vllm" bash benchmarks/env_ab.sh [ROUNDS]
# Each variant is NAME=ENV (ENV empty, or VAR=VALUE[,VAR=VALUE]); results under
# $OUT/envab_NAME_ROUND.json, the clock log in $OUT/smi.csv, run windows in
# $OUT/windows.txt (name, start, end in epoch seconds).
set -uo pipefail
source benchmarks/device_env.sh
Q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active
nvidia-smi --query-gpu=$Q --format=csv,noheader -lms 200 > "$OUT/smi.csv" 2>&1 &
SMI=$!
sleep 1
if ! kill -0 $SMI 2>/dev/null; then  # an older/newer driver without that field
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu \
    --format=csv,noheader -lms 200 > "$OUT/smi.csv" 2>&1 &
  SMI=$!
fi
W1="python -m pagedllm bench throughput --workload W1 --dummy llama3-8b --no-hf \
  --scheduling-policy throughput --repeats ${REPEATS:-2}"
for r in $(seq "${1:-1}"); do
  for v in ${VARIANTS:-base=}; do
    name=${v%%=*}; envs=${v#*=}
    t0=$(date +%s.%N)
    env ${envs//,/ } $W1 ${EXTRA_ARGS:-} --output-json "$OUT/envab_${name}_$r.json" 2>&1 \
      | grep -E "^W1|Error|error" | sed "s/^/$name r$r /"
    echo "$name $r $t0 $(date +%s.%N)" >> "$OUT/windows.txt"
  done
done
kill $SMI 2>/dev/null
# Per window: median SM clock and power over the window's last 60% (the timed runs).
python3 - "$OUT" <<'PY'
import datetime, statistics, sys
out = sys.argv[1]
rows = []
for line in open(f"{out}/smi.csv"):
    f = [x.strip() for x in line.split(",")]
    try:
        t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        rows.append((t, float(f[1].split()[0]), float(f[3].split()[0]), f[5] if len(f) > 5 else ""))
    except (ValueError, IndexError):
        continue
for w in open(f"{out}/windows.txt"):
    name, r, a, b = w.split()
    a, b = float(a), float(b)
    a = a + 0.4 * (b - a)
    sel = [x for x in rows if a <= x[0] <= b]
    if sel:
        reasons = sorted({x[3] for x in sel})
        print(f"{name} r{r}: SM clock median {statistics.median(x[1] for x in sel):.0f} MHz,"
              f" min {min(x[1] for x in sel):.0f}; power median "
              f"{statistics.median(x[2] for x in sel):.0f} W, max {max(x[2] for x in sel):.0f};"
              f" throttle {reasons}")
PY
