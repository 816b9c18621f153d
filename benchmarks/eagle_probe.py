"""EAGLE / EAGLE-3 speculative decoding on the GPU: lossless and timed, on tiny heads.

    PYTHONPATH=. python benchmarks/eagle_probe.py [--out eagle_probe.json]

The CPU tests' checkpoints (tests/spec_decode/eagle_heads.py, test_eagle_greedy.py),
run on CUDA -- Triton attention, CUDA graphs for the target, float32 so that greedy
ties cannot differ between a verify step's and a decode's kernels:

* ``eagle``: a 1-layer target and an EAGLE-1 head that nearly copies it (acceptance
  should be ~100%, as on the CPU);
* ``eagle3``: a 5-layer target and a random EAGLE-3 head over a 48-token draft
  vocabulary (acceptance ~0: the rollback path; the aux-state buffer under CUDA graphs).

Each: 8 prompts, 48 greedy tokens, with and without speculation, batched and with a
small KV cache (preemption); asserts identical tokens, prints and dumps (JSON) the
acceptance and the wall time of each run.  About a minute on an H200.  The head's cost
at the real shape is ``pagedllm bench latency --dummy llama3-8b --draft-dummy
eagle3-llama3-8b --speculative-config '{"method": "eagle3", "num_speculative_tokens": 3}'``.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

from pagedllm import LLM, SamplingParams
from tests.spec_decode.eagle_heads import tiny_target, write_head
from tests.spec_decode.test_eagle_greedy import VOCAB, _near_copy_head


def _generate(target: str, spec: dict | None, kv_bytes: int) -> tuple[list, float, LLM]:
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(6, 40))]}
               for _ in range(8)]
    llm = LLM(model=target, device="cuda", dtype="float32", skip_tokenizer_init=True,
              max_model_len=128, max_num_batched_tokens=64, kv_cache_memory_bytes=kv_bytes,
              speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0, llm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="eagle_probe.json")
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as d:
        _near_copy_head(f"{d}/h1", f"{d}/t1")
        hf = tiny_target(f"{d}/t5", VOCAB, layers=5)
        write_head(f"{d}/h3", "eagle3", hf.config, draft_vocab=48)
        for method, target, head in (("eagle", f"{d}/t1", f"{d}/h1"),
                                     ("eagle3", f"{d}/t5", f"{d}/h3")):
            want, t_plain, _ = _generate(target, None, 8 << 20)
            spec = {"method": method, "model": head, "num_speculative_tokens": 3}
            # ~24 blocks of 16 tokens: the 8 sequences (up to 88 tokens) do not all fit.
            got, t_spec, llm = _generate(target, spec, 24 * 16 * llm_kv_bytes(target, spec))
            sched = llm.llm_engine.client.core.scheduler
            r = {"identical": got == want, "preemptions": sched.total_preemptions,
                 "draft_tokens": sched.spec.total_draft_tokens,
                 "accepted_tokens": sched.spec.total_accepted_tokens,
                 "wall_s_plain": round(t_plain, 3), "wall_s_spec": round(t_spec, 3)}
            print(method, json.dumps(r), flush=True)
            results[method] = r
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    assert all(r["identical"] for r in results.values()), "speculation changed the output"
    assert results["eagle"]["accepted_tokens"] >= 0.8 * results["eagle"]["draft_tokens"]
    print("OK")


def llm_kv_bytes(target: str, spec: dict) -> int:
    """KV bytes per token of target + head (the memory plan's, from a throwaway engine's
    config: no second engine is started)."""
    from pagedllm.config import EngineArgs

    cfg = EngineArgs(model=target, device="cuda", dtype="float32", skip_tokenizer_init=True,
                     max_model_len=128, speculative_config=spec).create_engine_config()
    dc = cfg.scheduler_config.speculative_config.draft_model_config
    return cfg.model_config.kv_bytes_per_token() + dc.kv_bytes_per_token()


if __name__ == "__main__":
    main()
