"""An input-grounded workload (32 prompts): edit, correct, reformat or summarise a text
given in the prompt.  The answers copy long spans of their input, which is where n-gram
speculation (spec_decode/ngram.py) pays; ``pagedllm bench latency --workload grounded``."""

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
    """``python -m pagedllm.benchmarks.grounded [max_tokens] [k]``: greedy n-gram
    acceptance over all 32 prompts in one batch (acceptance does not depend on the batch:
    greedy outputs are the same), on the default model."""
    import sys

    from pagedllm import LLM, SamplingParams

    max_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    llm = LLM(quantization="none", max_model_len=1024, speculative_config={
        "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
        "disable_by_batch_size": 64})
    prompts = grounded_prompts(llm.get_tokenizer())
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                        use_tqdm=False)
    spec = llm.llm_engine.client.core.scheduler.spec
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{len(prompts)} prompts, {gen} tokens generated, k={k}: "
          f"{spec.total_drafts} verify steps, {spec.total_draft_tokens} draft tokens, "
          f"{spec.total_accepted_tokens} accepted; mean accepted length "
          f"{1 + spec.total_accepted_tokens / max(1, spec.total_drafts):.2f}, acceptance rate "
          f"{spec.total_accepted_tokens / max(1, spec.total_draft_tokens):.1%}")


if __name__ == "__main__":
    main()
