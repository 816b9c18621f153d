"""Reasoning parsers on outputs as Qwen3 / DeepSeek-R1 write them, whole and streamed in
random pieces; and a grammar that waits for the end of the reasoning (real xgrammar
matcher on the default model's tokenizer)."""

from __future__ import annotations

import random

import pytest

from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningStream, get_reasoning_parser

CASES = [
    ("deepseek_r1", "Let me think: 2+2.</think>The answer is 4.", "Let me think: 2+2.",
     "The answer is 4."),
    ("deepseek_r1", "<think>\nhmm, 日本語 ✓\n</think>\n\n4", "\nhmm, 日本語 ✓\n", "\n\n4"),
    ("deepseek_r1", "still thinking when cut off", "still thinking when cut off", None),
    ("qwen3", "<think>\nshort</think>\n\nParis.", "\nshort", "\n\nParis."),
    ("qwen3", "Paris, no thinking.", None, "Paris, no thinking."),
    ("qwen3", "<think>cut off", "cut off", None),
]


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_split_whole_and_streamed(name: str, text: str, reasoning: str | None,
                                  content: str | None) -> None:
    p = get_reasoning_parser(name)
    assert p.extract(text) == (reasoning, content)
    for seed in range(5):
        rng = random.Random(seed)
        s, r, c, i = ReasoningStream(p), "", "", 0
        while i < len(text):
            n = rng.randint(1, 5)
            dr, dc = s.feed(text[i:i + n])
            r, c, i = r + dr, c + dc, i + n
        dr, dc = s.finish()
        assert (r + dr or None, c + dc or None) == (reasoning, content)


def test_grammar_starts_after_reasoning_end(hf_default_tokenizer) -> None:
    from pagedllm.structured_output.backend import GrammarCompiler
    from pagedllm.structured_outputs_params import StructuredOutputsParams
    from pagedllm.worker.structured_output.matcher import GrammarState, fill_bitmask

    tok = hf_default_tokenizer
    vocab = len(tok)
    end = tok("</think>", add_special_tokens=False).input_ids
    so = StructuredOutputsParams(regex="[0-9]+", reasoning_end_token_ids=end)
    compiler = GrammarCompiler(lambda: tok, vocab)
    st = GrammarState(compiler.compile(so), [tok.eos_token_id], end)
    assert compiler.compile(so) is st.compiled  # cached
    free = fill_bitmask([st], vocab)
    assert bool((free == -1).all())  # thinking: unconstrained
    for t in tok("I think", add_special_tokens=False).input_ids + end:
        st.advance(t)
    mask = fill_bitmask([st], vocab)[0]
    allowed = [t for t in range(vocab) if (int(mask[t // 32]) >> (t % 32)) & 1]
    assert allowed and all(tok.decode([t]).strip().isdigit() for t in allowed)
    digit = tok("7", add_special_tokens=False).input_ids[0]
    st.advance(digit)
    assert st.num_accepted == 1 and not st.failed
    st.sync([])  # preempted before any output: back to the start, unconstrained
    assert not st.active and bool((fill_bitmask([st], vocab) == -1).all())
