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
