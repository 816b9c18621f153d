#!/usr/bin/env bash
# Run 15's check-and-measure call: GPU correctness of the last-layer pruning (CUDA-graph
# replay against eager, gpu_check's async / sync / eager / PDL-off / prune-off agreement),
# then W1 interleaved: pruning on (default), off (PAGEDLLM_PRUNE_LAST_LAYER=0), and on
# with cuBLASLt preferred (TORCH_BLAS_PREFER_CUBLASLT=1), clocks and power logged.
set -uo pipefail
source benchmarks/device_env.sh
{
step timeout 150 python -m pytest tests/e2e/test_cuda_graphs.py -q -rf -p no:cacheprovider
step timeout 200 python benchmarks/gpu_check.py
} 2>&1 | tee "$OUT/suite.log" | grep -E "passed|failed|error|identical|==="
VARIANTS="${VARIANTS:-prune= noprune=PAGEDLLM_PRUNE_LAST_LAYER=0 lt=TORCH_BLAS_PREFER_CUBLASLT=1}" \
  bash benchmarks/env_ab.sh "${ROUNDS:-2}"
