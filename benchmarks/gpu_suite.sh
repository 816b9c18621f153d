#!/usr/bin/env bash
# The device suite: GPU correctness checks and the benchmarks of docs/benchmarks.md on
# one GPU machine (H200 reference: Llama-3-8B shape, vLLM's dummy bf16 weights).
#
#   bash benchmarks/gpu_suite.sh [PART ...]          (repo root; results under $OUT)
#
# PARTS (default: check w4 w1 w1small):
#   check    gpu_check.py (greedy agreement: async/sync/eager), gpu_check_families.py
#            (DeepSeek / Gemma / Qwen2.5-VL tiny checkpoints against transformers) and the GPU parity,
#            CUDA-graph and PDL tests (PDL on against off, bit for bit)
#   w4       single-stream latency (pagedllm bench latency)
#   w1       offline throughput at the defaults (pagedllm bench throughput --workload W1;
#            the offline default policy is throughput)
#   w1fcfs   W1 under the FCFS policy (--scheduling-policy fcfs, the server's default)
#   w1small  W1-small on the SmolLM2-135M shape (host overhead)
#   w5       long prompts (W5: 384 requests, 64-2048 in, 16-768 out), default policy
#   w5fcfs   W5 under the FCFS policy
#   loracheck  the LoRA kernel / gemv_rope tests and the LoRA tests on the GPU
#   hybrid   issue 23's target: Gemma-3-12B shape, W5 with the hybrid KV cache manager
#            vs --disable-hybrid-kv-cache-manager (tok/s, peak KV blocks/GiB in use), then
#            the GPU greedy check of tests/e2e/test_hybrid_kv_greedy.py (CUDA graphs)
#   deepseek issue 42's targets: the MLA / block-FP8 kernel tests and the MLA decode
#            bandwidth (bf16 and fp8 latent cache), then DeepSeek-V2-Lite W4 and W1,
#            their profiles and the sorted MoE kernels' sweep for its expert shape;
#            the header and JSON give KV bytes per token and the blocks a GQA cache of
#            the same memory would hold (gqa_equivalent)
#   vlm      issue 41's targets: Qwen2.5-VL-7B shape, V1 (256 requests of one 448x448
#            image + 64-256 text tokens, 128 out) with a different image per request and
#            with --repeat-image (encoder-cache hit rate, encoder share of the wall time),
#            V1's TTFT at batch 1 (bench latency --workload V1), then W1 text-only on the
#            VLM and on its decoder alone (qwen2.5-7b): the two should be within 2%
#   lora     issue 26's targets: W1 (default policy) base vs 8 dummy rank-16 adapters spread over
#            the requests, W4 base vs one adapter (bench ... --lora N).  LORA_VARIANTS
#            adds W1 variants, e.g. "lora16=--lora,16"
#   specdraft  speculative decoding with a draft model (issue 25): SmolLM2 GGUF
#            ($SMOLLM2_GGUF) self-draft and n-gram on G32, 8B dummy with a 1B dummy draft
#   gemma    issue 43: the Gemma tiny checkpoints against transformers on the GPU, the
#            Gemma kernel tests, then Gemma-3-12B W4 and W1
#   int4     issue 43: int4 layers with / without zero points through the engine's routing
#            (int4_layer_bench.py), the K-major kernels' sweep (wna16_kmajor_sweep.py),
#            then W4 and W1 of llama3-8b-w4a16 (symmetric: striped) and -asym (K-major)
#   w6       issue 45: the host tier's GPU copy tests, then the multi-turn benchmark, host
#            tier off / on (600 conversations x 4 turns, fp8 KV: a 108 GiB working set,
#            2.9x the 40 GB device pool, fits device + an 88 GiB host pool on 128 GiB)
#   w2       online serving at 10 and 20 req/s (benchmarks/w2_suite.sh; RATES to change)
#   w3       shared prefix, prefix caching on vs off (benchmarks/w3_suite.sh gpu)
#   startup  cold then warm server start to the first /health 200 (startup_probe.sh)
#   profile  per-step host profile and kernel totals of W1 (profile_step.py; PROFILE_ARGS
#            adds flags, e.g. "--quantization fp8")
#   fp8attn  the fp8 KV cache's kernel tests on the GPU (test_fp8_kv.py)
#   fp8gemm  sweep the Triton FP8 GEMM against cuBLASLt at decode-sized M and write
#            $OUT/fp8_gemm_<GPU>.json (fp8_gemm_sweep.py; ship it under
#            pagedllm/kernels/tuned/), then test_fp8_gemm.py
#   pytest   every kernel test on the GPU, the gpu-marked model/sampler tests, then the
#            attention grid (~100 kernel variants; long)
#
# A/B variants, same lease, interleaved (for w4 / w1 / w1fcfs / w1small / w5 / w5fcfs):
#   VARIANTS="base= eager=--enforce-eager" ROUNDS=2 bash benchmarks/gpu_suite.sh w1 w4
# Each variant is NAME=SPEC, SPEC a comma-separated list of environment settings
# (VAR=VALUE) and engine flags (from the first --flag on), e.g. FP8 against bf16:
#   VARIANTS="bf16= fp8=--quantization,fp8 fp8kv=--quantization,fp8,--kv-cache-dtype,fp8" \
#     bash benchmarks/gpu_suite.sh w1 w4 w5
# Results are $OUT/<part>_<name>_<round>.json.  EXTRA_ARGS adds engine flags to every run (e.g.
# "--max-num-batched-tokens 8192"); REPEATS sets W1's repeats per process (default 2).
# CLOCKS=1 logs the GPU's SM clock, power and throttle reasons every 200 ms and prints
# their medians per run (W1 runs at the H200's power cap: docs/findings.md, run 14).
#
# One device call may run 10 minutes: W1 x2 variants x2 rounds plus W4 fit; put pytest
# in a call of its own.  Carried wheels in .whl are installed by device_env.sh.
set -uo pipefail
source benchmarks/device_env.sh
PARTS=${*:-check w4 w1 w1small}
ROUNDS=${ROUNDS:-1}
VARIANTS=${VARIANTS:-base=}
W1="python -m pagedllm bench throughput --workload W1 --dummy llama3-8b --no-hf \
  --repeats ${REPEATS:-2}"

clock_log_start() {
  [ "${CLOCKS:-0}" = 1 ] || return 0
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,clocks_throttle_reasons.active \
    --format=csv,noheader -lms 200 > "$OUT/smi.csv" 2>&1 &
  SMI=$!
}

clock_log_report() {
  [ "${CLOCKS:-0}" = 1 ] || return 0
  kill "$SMI" 2>/dev/null
  # Per run window: median SM clock and power over its last 60% (the timed part).
  python3 - "$OUT" <<'PY'
import datetime, statistics, sys
out = sys.argv[1]
rows = []
for line in open(f"{out}/smi.csv"):
    f = [x.strip() for x in line.split(",")]
    try:
        t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        rows.append((t, float(f[1].split()[0]), float(f[2].split()[0]), f[3:]))
    except (ValueError, IndexError):
        continue
for w in open(f"{out}/windows.txt"):
    name, a, b = w.split()
    a, b = float(a), float(b)
    sel = [x for x in rows if a + 0.4 * (b - a) <= x[0] <= b]
    if sel:
        print(f"{name}: SM clock median {statistics.median(x[1] for x in sel):.0f} MHz, "
              f"power median {statistics.median(x[2] for x in sel):.0f} W, "
              f"throttle {sorted({r for x in sel for r in x[3]})}")
PY
}

# ab PART CMD...: CMD once per variant and round, interleaved, JSON per run.
ab() {
  local part=$1; shift
  for r in $(seq "$ROUNDS"); do
    for v in $VARIANTS; do
      local name=${v%%=*} spec=${v#*=} t0 item
      local -a envs=() flags=()
      IFS=, read -ra items <<< "$spec"
      for item in "${items[@]}"; do  # VAR=VALUE until the first --flag, then flags
        if [[ $item == --* || ${#flags[@]} -gt 0 ]]; then flags+=("$item")
        elif [[ -n $item ]]; then envs+=("$item"); fi
      done
      t0=$(date +%s.%N)
      echo "=== $part $name round $r: ${spec:-defaults}"
      env "${envs[@]}" "$@" "${flags[@]}" ${EXTRA_ARGS:-} \
        --output-json "$OUT/${part}_${name}_$r.json" 2>&1 | grep --line-buffered -vE "^(INFO|DEBUG)"
      echo "${part}_${name}_$r $t0 $(date +%s.%N)" >> "$OUT/windows.txt"
    done
  done
}

{
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
clock_log_start
for part in $PARTS; do
  case $part in
    check)
      step python benchmarks/gpu_check.py
      step timeout 120 python benchmarks/gpu_check_families.py
      step timeout 240 python -m pytest tests/e2e/test_gpu_parity.py \
        tests/e2e/test_cuda_graphs.py tests/kernels/test_pdl.py -m gpu -q -p no:cacheprovider ;;
    w4) ab w4 python -m pagedllm bench latency --dummy llama3-8b ;;
    w1) ab w1 $W1 ;;
    w1fcfs) ab w1fcfs $W1 --scheduling-policy fcfs ;;
    w1small) ab w1small python -m pagedllm bench throughput --workload W1-small \
      --dummy smollm2-135m --no-hf ;;
    w5) ab w5 python -m pagedllm bench throughput --workload W5 --dummy llama3-8b --no-hf \
      --repeats "${REPEATS:-1}" ;;
    w5fcfs) ab w5fcfs python -m pagedllm bench throughput --workload W5 --dummy llama3-8b \
      --no-hf --repeats "${REPEATS:-1}" --scheduling-policy fcfs ;;
    deepseek)
      step timeout 200 python -m pytest -q -p no:cacheprovider tests/kernels/test_mla_decode.py \
        tests/kernels/test_mla_fp8.py tests/kernels/test_fp8_block_gemm.py \
        tests/kernels/test_mla_prefill.py
      step timeout 120 python benchmarks/mla_fp8_bench.py --sections mla
      # The fp8 latent cache ran at 18% of the bandwidth on the H100 (bf16: 56%): sweep it.
      step timeout 120 python benchmarks/mla_fp8_bench.py --sections mla --kv-cache-dtype fp8 \
        --sweep
      cp "$OUT/mla_fp8_bench.json" "$OUT/mla_fp8_sweep.json"
      # W1's decode steps: ~250 requests at every stage, one program each (a length-
      # balanced split helped the kernel 11% and W1 nothing: docs/benchmarks.md)
      step timeout 200 python benchmarks/mla_fp8_bench.py --sections mla --sweep --batch 256 \
        --context 1536 --context-min 128
      ab dsw4 python -m pagedllm bench latency --dummy deepseek-v2-lite
      # --vocab-hi 102399: vLLM's request set for this shape (68,960 output tokens)
      ab dsw1 python -m pagedllm bench throughput --workload W1 --dummy deepseek-v2-lite \
        --no-hf --vocab-hi 102399 --repeats "${REPEATS:-1}"
      # Where W4's prompt step and W1's time go, then the sorted MoE kernels' sweep for
      # (64, 1408, 2048) (it prints a CONFIGS entry for kernels/fused_moe_configs.py).
      mkdir -p "$OUT/dsprof/w4" "$OUT/dsprof/w1"
      step timeout 90 python benchmarks/profile_step.py --dummy deepseek-v2-lite --w4 \
        --per-step --no-cprofile --out "$OUT/dsprof/w4"
      step timeout 120 python benchmarks/profile_step.py --dummy deepseek-v2-lite \
        --num-prompts 256 --no-cprofile --out "$OUT/dsprof/w1"
      step timeout 300 python benchmarks/moe_bench.py --shapes deepseek-v2-lite --sweep \
        --out "$OUT/moe_sweep_deepseek.json" ;;
    vlm)
      V1="python -m pagedllm bench throughput --workload V1 --dummy qwen2.5-vl-7b --no-hf"
      ab v1 $V1
      ab v1repeat $V1 --repeat-image
      ab v1ttft python -m pagedllm bench latency --workload V1 --dummy qwen2.5-vl-7b
      ab w1vlm python -m pagedllm bench throughput --workload W1 --dummy qwen2.5-vl-7b \
        --no-hf --repeats "${REPEATS:-1}"
      ab w1qwen python -m pagedllm bench throughput --workload W1 --dummy qwen2.5-7b \
        --no-hf --repeats "${REPEATS:-1}" ;;
    loracheck)
      step timeout 240 python -m pytest tests/kernels/test_lora_kernels.py \
        tests/kernels/test_gemv_rope.py tests/lora -q -rf -p no:cacheprovider ;;
    hybrid)
      VARIANTS="hybrid= nohybrid=--disable-hybrid-kv-cache-manager" ab w5gemma3 \
        python -m pagedllm bench throughput --workload W5 --dummy gemma-3-12b --no-hf \
        --max-model-len 4096 --repeats "${REPEATS:-1}"
      step timeout 300 python -m pytest -q -m gpu -p no:cacheprovider \
        tests/e2e/test_hybrid_kv_greedy.py ;;
    lora)
      VARIANTS="base= lora1=--lora,1" ab w4lora python -m pagedllm bench latency \
        --dummy llama3-8b
      VARIANTS="base= lora8=--lora,8 ${LORA_VARIANTS:-}" ab w1lora $W1 ;;
    specdraft)
      # Issue 25, draft model: the real SmolLM2 GGUF ($SMOLLM2_GGUF, carried) on G32
      # without speculation, drafting for itself (acceptance must be ~100%) and with
      # n-gram; then the 8B shape with a 1B-shape draft, dummy weights (acceptance ~0:
      # the cost of a draft round plus a rejected verify step).
      G=${SMOLLM2_GGUF:?set SMOLLM2_GGUF to the carried SmolLM2 .gguf}
      L="python -m pagedllm bench latency --model $G --workload grounded --num-prompts 8 \
        --output-len 64 ${SMOLLM2_TOKENIZER:+--tokenizer $SMOLLM2_TOKENIZER}"
      step $L --output-json "$OUT/specdraft_g32_off.json"
      step $L --speculative-config "{\"model\": \"$G\", \"num_speculative_tokens\": 4}" \
        --output-json "$OUT/specdraft_g32_self.json"
      step $L --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' \
        --output-json "$OUT/specdraft_g32_ngram.json"
      step python -m pagedllm bench latency --dummy llama3-8b --num-prompts 4 \
        --output-json "$OUT/specdraft_8b_off.json"
      step python -m pagedllm bench latency --dummy llama3-8b --num-prompts 4 \
        --draft-dummy llama3.2-1b --output-json "$OUT/specdraft_8b_draft1b.json" ;;
    gemma)
      step timeout 120 python -c "import sys; sys.path.insert(0, 'benchmarks'); \
import gpu_check_families as g; g.gemma('gemma3'); g.gemma('gemma2')"
      step timeout 120 python -m pytest -q -p no:cacheprovider \
        tests/kernels/test_gemma_kernels.py tests/kernels/test_elementwise.py
      ab gemmaw4 python -m pagedllm bench latency --dummy gemma-3-12b
      ab gemmaw1 python -m pagedllm bench throughput --workload W1 --dummy gemma-3-12b \
        --no-hf --repeats "${REPEATS:-1}" ;;
    int4)
      step timeout 200 python -m pytest -q -p no:cacheprovider \
        tests/kernels/test_int4_kmajor_layer.py tests/kernels/test_wna16_kmajor.py \
        tests/kernels/test_wna16_tc.py
      step timeout 150 python benchmarks/int4_layer_bench.py "$OUT/int4_layers.json"
      step timeout 400 python benchmarks/wna16_kmajor_sweep.py --out "$OUT/kmajor_sweep.json"
      for d in llama3-8b-w4a16 llama3-8b-w4a16-asym; do
        ab "w4_$d" python -m pagedllm bench latency --dummy "$d"
        ab "w1_$d" python -m pagedllm bench throughput --workload W1 --dummy "$d" --no-hf \
          --repeats "${REPEATS:-1}"
      done ;;
    w6)
      # The host tier's copies (GPU kernels over the mapped pool) first, then the workload.
      step timeout 120 python -m pytest -q -p no:cacheprovider -m gpu \
        tests/kernels/test_block_ops.py tests/kernels/test_disk_pool.py
      step python -m pagedllm bench multiturn --dummy llama3-8b --max-model-len 4096 \
        --kv-cache-dtype fp8 --kv-cache-memory-bytes 40e9 --kv-offload-size 88 \
        --output-json "$OUT/w6.json" ;;
    w2) step env RATES="${RATES:-10 20}" bash benchmarks/w2_suite.sh ;;
    w3) step bash benchmarks/w3_suite.sh gpu ;;
    startup) step bash benchmarks/startup_probe.sh 2 ;;
    fp8attn)
      step python -m pytest -q -m gpu tests/kernels/test_fp8_kv.py ;;
    fp8gemm)
      step python benchmarks/fp8_gemm_sweep.py --ms 2,4,8,16,32,64,96,128,192,256,384,512 \
        --table "$OUT/fp8_gemm_$(python -c 'import torch; print(torch.cuda.get_device_name().replace(" ", "_"))').json"
      step python -m pytest -q tests/kernels/test_fp8_gemm.py ;;
    profile) step python benchmarks/profile_step.py --dummy llama3-8b --num-prompts 256 \
      --no-cprofile --out "$OUT" ${PROFILE_ARGS:-} ;;
    pytest)
      step timeout 300 python -m pytest tests/kernels -q -rf -p no:cacheprovider \
        -k "not test_gpu_grid"
      step timeout 180 python -m pytest tests/models tests/sample -m gpu -q -x \
        -p no:cacheprovider
      step timeout 420 python -m pytest tests/kernels/test_paged_attention.py -m gpu -q \
        -p no:cacheprovider -k test_gpu_grid ;;
    *) echo "unknown part: $part (see the head of benchmarks/gpu_suite.sh)"; exit 2 ;;
  esac
done
clock_log_report
} 2>&1 | tee "$OUT/suite.log"
