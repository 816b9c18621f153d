#!/usr/bin/env bash
# Run 15's closing call: run 14's (W1 x3, W1-small, W2 at 10 and 20 req/s) with W4 after W1.
exec env W4=1 bash benchmarks/run14_final.sh "$@"
