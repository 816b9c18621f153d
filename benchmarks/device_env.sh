# Sourced by the device suites: $OUT, carried wheels (.whl) on PYTHONPATH, unbuffered
# Python, and `step CMD...` which prints a command's exit status and duration.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
step() { echo "=== $*"; local t=$SECONDS; "$@"; echo "=== rc=$? in $((SECONDS - t)) s"; }
# wait_healthy PORT PID LOG T0: poll the server's /health until 200 (exit 1 with its log
# if it dies first), then print "ready to serve in X s" counted from T0 (date +%s.%N).
wait_healthy() {
  for _ in $(seq 1800); do
    curl -sf "http://127.0.0.1:$1/health" > /dev/null && break
    kill -0 "$2" 2>/dev/null || { echo "server exited"; cat "$3"; exit 1; }
    sleep 0.1
  done
  echo "ready to serve in $(python -c "import time; print(round(time.time() - $4, 1))") s"
}
