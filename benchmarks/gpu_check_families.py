"""GPU greedy check of the DeepSeek (MLA), Gemma 2/3 and vision-language families: the
tests' tiny random checkpoints (``tests/models/deepseek_tiny.py``,
``tests/models/tiny_models.py``, ``tests/models/tiny_qwen_vl.py``) through the engine on
the GPU -- in fp32, in bf16 with CUDA graphs and (DeepSeek) in bf16 eager -- against two
references: transformers in fp32 on the CPU, and (text models) the engine itself on the
CPU in fp32, which the tests hold equal to the newest transformers where the GPU
machine's may be older.  DeepSeek's second pass is served from the prefix cache and
must repeat the first.  Prints agreement counts (bf16 may differ from the fp32
reference by rounding); asserts nothing.

Usage (repository root): ``python benchmarks/gpu_check_families.py``; ``DEV=cpu`` runs it
on the CPU (a smoke test of the script itself).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback

import transformers

from pagedllm import LLM, SamplingParams

sys.path.insert(0, ".")  # the tests' checkpoint builders
NEW = 10
DEV = os.environ.get("DEV", "cuda")


def agree(a: list, b: list) -> tuple[int, int]:
    return sum(x == y for x, y in zip(a, b)), len(a)


def text_family(label: str, build: object, vocab: int, runs: list[tuple[str, dict]],
                passes: int = 1) -> None:
    """A tiny text checkpoint (``build(path)``) through the engine on ``DEV`` for each of
    ``runs`` (label, extra ``LLM`` arguments) against transformers fp32 on the CPU; with
    ``passes`` 2 the prompts go twice in one call (prefix caching on: the second pass is
    served from the cache and must repeat the first)."""
    from tests.e2e.hf_greedy import hf_greedy, shared_prefix_prompts
    d = tempfile.mkdtemp()
    hf = build(d)  # type: ignore[operator]
    prompts = shared_prefix_prompts(vocab)
    ref = hf_greedy(hf, prompts, NEW)
    p = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    n = len(prompts)

    def engine(device: str, kw: dict) -> list[list[int]]:
        llm = LLM(d, skip_tokenizer_init=True, device=device, max_model_len=128,
                  kv_cache_memory_bytes=64 << 20, enable_prefix_caching=True, **kw)
        outs = [list(o.outputs[0].token_ids)
                for o in llm.generate(prompts * passes, p, use_tqdm=False)]
        llm.shutdown()
        return outs

    # The engine on the CPU in fp32 is the second reference: the tests hold it equal to
    # the newest transformers, and a GPU machine may carry an older one (transformers
    # 5.17 greedy-decodes the Gemma 2 tiny model differently from 5.25).
    cpu = engine("cpu", dict(dtype="float32"))[:n] if DEV != "cpu" else ref
    print(f"{label}: transformers {transformers.__version__}; the engine on the CPU "
          f"(fp32) agrees with it on {agree(cpu, ref)} seqs", flush=True)
    for run, kw in runs:
        outs = engine(DEV, kw)
        cached = f"; prefix-cached pass equal: {outs[:n] == outs[n:]}" if passes > 1 else ""
        print(f"{label} {run}: {agree(outs[:n], ref)} exact seqs vs HF fp32 cpu, "
              f"{agree(outs[:n], cpu)} vs the engine on the CPU{cached}", flush=True)


def ds(name: str) -> None:
    from tests.models.deepseek_tiny import VOCAB, build
    text_family(f"deepseek {name}", lambda d: build(name, d), VOCAB,
                [("fp32", dict(dtype="float32")), ("bf16", dict(dtype="bfloat16")),
                 ("bf16-eager", dict(dtype="bfloat16", enforce_eager=True))], passes=2)


def gemma(arch: str) -> None:
    """Gemma's Triton norms and GELU-tanh activation (the GPU path only) against HF."""
    from tests.models.tiny_models import VOCAB, build
    text_family(arch, lambda d: build(arch, d), VOCAB,
                [("fp32", dict(dtype="float32")), ("bf16", dict(dtype="bfloat16"))])


def vl() -> None:
    from pagedllm.multimodal.hf_processor import load_hf_processor
    from tests.models.tiny_qwen_vl import IMG, build_qwen2_5_vl, hf_generate, image
    d = tempfile.mkdtemp()
    model = build_qwen2_5_vl(d)
    proc = load_hf_processor(d)
    prompt = f"user : {IMG} describe the image </s> assistant :"
    imgs = [image(i) for i in range(3)]
    ref = [hf_generate(model, proc, prompt, [im], NEW) for im in imgs]
    p = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for label, kw in [("fp32", dict(dtype="float32")), ("bf16", dict(dtype="bfloat16"))]:
        llm = LLM(d, device=DEV, max_model_len=256, kv_cache_memory_bytes=64 << 20, **kw)
        reqs = [{"prompt": prompt, "multi_modal_data": {"image": im}} for im in imgs]
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(reqs, p, use_tqdm=False)]
        llm.shutdown()
        print(f"qwen2.5-vl {label}: {agree(outs, ref)} exact seqs vs HF fp32 cpu", flush=True)


def main() -> None:
    for label, run in [("deepseek v2_lite", lambda: ds("v2_lite")),
                       ("deepseek v3", lambda: ds("v3")), ("qwen2.5-vl", vl),
                       ("gemma3", lambda: gemma("gemma3")),
                       ("gemma2", lambda: gemma("gemma2"))]:
        t = time.time()
        try:
            run()
        except Exception:  # noqa: BLE001  (report and go on to the next family)
            traceback.print_exc()
        print(f"--- {label}: {time.time() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main()
