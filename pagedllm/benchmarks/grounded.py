"""An input-grounded workload (32 prompts): edit, correct, reformat or summarise a text
given in the prompt.  The answers copy long spans of their input, which is where n-gram
speculation (worker/spec_decode/ngram.py) pays; ``pagedllm bench latency --workload grounded``."""

from __future__ import annotations

from typing import Any

PASSAGES = [
    "The town library opens at nine in the morning and closes at six in the evening. "
    "Members may borrow up to five books at a time, and each loan lasts three weeks. "
    "Late returns cost ten cents per day, and lost books must be replaced.",
    "Our team meeting is moved from Tuesday to Thursday at two o'clock in room 301. "
    "Please bring the quarterly report, the updated budget and your project timeline. "
    "If you cannot attend, send your notes to Maria before Wednesday evening.",
    "To make the bread, mix four cups of flour with one packet of yeast and a spoon of "
    "salt. Add two cups of warm water and knead the dough for ten minutes. Let it rise "
    "for one hour, shape it into a loaf and bake it at two hundred degrees for forty "
    "minutes.",
    "The river flows from the mountains in the north to the sea in the south. In spring "
    "the melting snow makes the water rise, and the farmers along the banks open the "
    "old canals to water their fields of wheat and barley.",
    "Dear customer, thank you for your order number 4471. Your package was shipped on "
    "Monday and should arrive within five business days. You can track it on our "
    "website with the code we sent to your email address.",
    "The new train line connects the airport with the city center in eighteen minutes. "
    "Trains leave every ten minutes from five in the morning until midnight, and a "
    "single ticket costs four euros for adults and two euros for children.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and "
    "carbon dioxide into sugar and oxygen. It takes place in the chloroplasts, which "
    "contain the green pigment chlorophyll.",
    "The museum will host a special exhibition of ancient coins from March to June. "
    "Guided tours start at eleven and at three every day except Monday, and students "
    "with a valid card enter for free.",
]

TASKS = [
    "Repeat the following text exactly, word for word.",
    "Rewrite the following text, replacing every number written in words with digits. "
    "Keep everything else the same.",
    "Correct any mistakes in the following text and return the full corrected text.",
    "Summarise the following text in two sentences, reusing its wording.",
]


def grounded_messages() -> list[list[dict[str, str]]]:
    """The 32 chat conversations (8 passages x 4 tasks)."""
    return [[{"role": "user", "content": f"{task}\n\nText:\n{text}"}]
            for text in PASSAGES for task in TASKS]


def grounded_prompts(tokenizer: Any) -> list[list[int]]:
    """The 32 prompts as token ids, through the model's chat template."""
    out = []
    for msgs in grounded_messages():
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        out.append(list(ids))
    return out


def main() -> None:
    """``python -m pagedllm.benchmarks.grounded``: the grounded prompts, greedy, on the
    default model (fp32), in batches of ``--batch-size``: wall time without and with
    n-gram speculation (``disable_by_batch_size`` raised so every step may carry drafts),
    the speedup, and the acceptance (mean accepted length = 1 + accepted / verify steps)."""
    import argparse
    import json
    import time

    from pagedllm import LLM, SamplingParams

    p = argparse.ArgumentParser(prog="python -m pagedllm.benchmarks.grounded")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--speculative-config", type=json.loads, default=None,
                   help="Replace the n-gram config, e.g. a draft model: "
                        "'{\"model\": PATH, \"num_speculative_tokens\": 4}'.")
    p.add_argument("--acceptance-only", action="store_true",
                   help="Run only the speculating engine (acceptance, no speedup).")
    args = p.parse_args()
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k,
                "prompt_lookup_max": args.prompt_lookup_max, "disable_by_batch_size": 1024}
    if args.speculative_config is not None:
        spec_cfg = {"disable_by_batch_size": 1024, **args.speculative_config}
    # Both engines live side by side and take turns batch by batch, so that the load of a
    # shared machine falls on both alike.
    llms = {name: LLM(quantization="none", max_model_len=1024,
                      kv_cache_memory_bytes=256 << 20, speculative_config=spec)
            for name, spec in (("off", None), ("spec", spec_cfg))
            if not (args.acceptance_only and spec is None)}
    prompts = grounded_prompts(llms["spec"].get_tokenizer())[:args.num_prompts]
    for llm in llms.values():
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    spec = llms["spec"].llm_engine.client.core.scheduler.spec
    base = (spec.total_drafts, spec.total_accepted_tokens, spec.total_draft_tokens)
    res = {"off": 0.0, "spec": 0.0}
    outs: dict[str, list] = {"off": [], "spec": []}
    for i in range(0, len(prompts), args.batch_size):
        for name, llm in llms.items():
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            outs[name].extend(llm.generate(prompts[i:i + args.batch_size], sp,
                                           use_tqdm=False))
            res[name] += time.perf_counter() - t0
    drafts, acc, dtok = (spec.total_drafts - base[0], spec.total_accepted_tokens - base[1],
                         spec.total_draft_tokens - base[2])
    gen = sum(len(o.outputs[0].token_ids) for o in outs["spec"])
    if args.acceptance_only:
        print(f"{args.num_prompts} prompts, batch {args.batch_size}, {gen} tokens, "
              f"k={args.k}: {drafts} verify steps, mean accepted length "
              f"{1 + acc / max(1, drafts):.2f}, acceptance rate {acc / max(1, dtok):.1%}")
        return
    label = spec_cfg.get("method") or ("draft_model" if "model" in spec_cfg else "ngram")
    same = all(a.outputs[0].token_ids == b.outputs[0].token_ids
               for a, b in zip(outs["off"], outs["spec"]))
    print(f"{args.num_prompts} prompts, batch {args.batch_size}, {gen} tokens, k={args.k}: "
          f"off {res['off']:.1f} s, {label} {res['spec']:.1f} s, speedup "
          f"{res['off'] / res['spec']:.2f}x; {drafts} verify steps, mean accepted length "
          f"{1 + acc / max(1, drafts):.2f}, acceptance rate {acc / max(1, dtok):.1%}; "
          f"outputs identical: {same}")


if __name__ == "__main__":
    main()
