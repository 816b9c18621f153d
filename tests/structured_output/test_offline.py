"""Structured outputs and the sampling extras through the offline ``LLM`` API, on the
default SmolLM2 GGUF model: outputs are checked with ``json``/``jsonschema``/``re``
(the formats' own libraries), and greedy grammar-constrained outputs must be identical
under async scheduling, recompute preemption (a tiny KV pool) and batching."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.structured_outputs_params import StructuredOutputsParams as SO

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
PROMPTS = ["Describe a person as JSON:", "A user record in JSON:", "JSON for a student:",
           "Write a JSON object about a cat owner:"]


def _greedy(so: SO | None, max_tokens: int = 32, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so,
                          **kw)


def test_json_schema_regex_choice_grammar(llm: LLM) -> None:
    outs = llm.generate(PROMPTS[:2], _greedy(SO(json=PERSON)), use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    [o] = llm.generate(["Call me at"], _greedy(SO(regex=r"\d{3}-\d{4}")), use_tqdm=False)
    assert re.fullmatch(r"\d{3}-\d{4}", o.outputs[0].text)
    [o] = llm.generate(["Pick a colour"], SamplingParams(
        n=4, temperature=1.0, seed=3, max_tokens=8,
        structured_outputs=SO(choice=["red", "green", "blue"])), use_tqdm=False)
    assert {c.text for c in o.outputs} <= {"red", "green", "blue"}
    ebnf = 'root ::= "answer: " ("yes" | "no") "."'
    [o] = llm.generate(["Is water wet?"], _greedy(SO(grammar=ebnf)), use_tqdm=False)
    assert re.fullmatch(r"answer: (yes|no)\.", o.outputs[0].text)
    [o] = llm.generate(["Some JSON:"], _greedy(SO(json_object=True), max_tokens=24),
                       use_tqdm=False)
    if o.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(o.outputs[0].text), dict)
    else:  # truncated by max_tokens: still a prefix of an object
        assert o.outputs[0].text.lstrip().startswith("{")


def test_unconstrained_rows_unchanged_by_constrained_neighbours(llm: LLM) -> None:
    plain = _greedy(None, max_tokens=8)
    alone = llm.generate(PROMPTS[:2], plain, use_tqdm=False)
    mixed = llm.generate(PROMPTS[:2] + PROMPTS[:2],
                         [plain, plain, _greedy(SO(json=PERSON), max_tokens=8),
                          _greedy(SO(regex="[a-z]+"), max_tokens=8)],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == \
        [o.outputs[0].token_ids for o in mixed[:2]]


def test_async_scheduling_and_preemption_give_the_same_tokens(llm: LLM) -> None:
    # All four constrained, so they are admitted together once their grammars compile.
    params = [_greedy(SO(json=PERSON)), _greedy(SO(regex=r"[A-Z][a-z]{2,8} [0-9]{2}")),
              _greedy(SO(json=PERSON)), _greedy(SO(json=PERSON))]
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    # 5 blocks of 16 tokens for four requests of 2 blocks each: they preempt each other.
    small = LLM(kv_cache_memory_bytes=4_700_000, max_model_len=80, async_scheduling=True,
                enable_prefix_caching=True)
    try:
        outs = small.generate(PROMPTS, params, use_tqdm=False)
        stats = small.llm_engine.client.core.scheduler.total_preemptions
        again = small.generate(PROMPTS, params, use_tqdm=False)  # prefix-cache hits
    finally:
        small.llm_engine.shutdown()
    assert stats > 0
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert [o.outputs[0].token_ids for o in again] == ref


@pytest.mark.parametrize("so, needle", [
    (SO(json='{"type": "nonsense"}'), "Unsupported type"),
    (SO(json='{"type": '), "not valid JSON"),
    (SO(regex="(ab"), "parenthesis"),
    (SO(grammar="root ::= undefined_rule"), "not defined"),
    (SO(regex="[^\\s\\S]"), "matches no string"),  # parses, compiles, empty
    (SO(regex="(ab|c)[^\\s\\S]"), "matches no string"),  # dead after the first bytes
])
def test_bad_constraints_raise_value_error_naming_the_field(llm: LLM, so: SO,
                                                            needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as e:
        llm.generate(["x"], _greedy(so), use_tqdm=False)
    assert str(e.value).startswith("structured_outputs")
    assert "/project" not in str(e.value)  # no C++ source paths
    [ok] = llm.generate(["x"], _greedy(SO(choice=["fine"])), use_tqdm=False)
    assert ok.outputs[0].text == "fine"


def test_structured_outputs_params_validation() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        SO()
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        SO(choice=[])
    with pytest.raises(ValueError, match="beam"):
        SamplingParams(temperature=0, use_beam_search=True, n=2,
                       structured_outputs=SO(regex="a"))
    # clone keeps it as a StructuredOutputsParams
    p = SamplingParams(structured_outputs=SO(json=PERSON)).clone(max_tokens=3)
    assert isinstance(p.structured_outputs, SO) and p.structured_outputs.json == PERSON


def test_allowed_token_ids_bad_words_and_logits_processors(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    allowed = tok(" yes no maybe", add_special_tokens=False).input_ids
    [o] = llm.generate(["Say something:"], _greedy(None, max_tokens=4,
                                                   allowed_token_ids=allowed),
                       use_tqdm=False)
    assert set(o.outputs[0].token_ids) <= set(allowed)

    [base] = llm.generate(["The capital of France is"], _greedy(None, max_tokens=4),
                          use_tqdm=False)
    word = base.outputs[0].text.split()[0]
    [o] = llm.generate(["The capital of France is"],
                       _greedy(None, max_tokens=4, bad_words=[word]), use_tqdm=False)
    banned = {tuple(tok(t, add_special_tokens=False).input_ids)
              for t in (word, " " + word)}
    ids = o.outputs[0].token_ids
    for b in banned:
        assert not any(tuple(ids[i:i + len(b)]) == b for i in range(len(ids)))

    seen: list[int] = []
    target = tok(" banana", add_special_tokens=False).input_ids[0]

    def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append(len(output_ids))
        logits = logits.clone()
        logits[target] = 1e4
        return logits

    [o] = llm.generate(["Fruit:"], _greedy(None, max_tokens=4, logits_processors=[force]),
                       use_tqdm=False)
    assert o.outputs[0].token_ids == [target] * 4
    assert seen == [0, 1, 2, 3]  # each call sees the output so far
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate(["x"], _greedy(None, allowed_token_ids=[10**7]), use_tqdm=False)


def test_structured_params_cross_the_wire() -> None:
    """The core process gets them through msgpack (engine/messages.py), intact."""
    import msgspec

    from pagedllm.messages import EngineCoreRequest

    sp = SamplingParams(structured_outputs=SO(json=PERSON, reasoning_end_token_ids=[7]),
                        bad_words_token_ids=[[3, 4]], allowed_token_ids=[1, 2])
    wire = msgspec.msgpack.encode([EngineCoreRequest("r", [1], sp, 0.0)])
    [back] = msgspec.msgpack.Decoder(list[EngineCoreRequest]).decode(wire)
    got = back.sampling_params
    assert got.structured_outputs == sp.structured_outputs
    assert got.structured_outputs.key() == sp.structured_outputs.key()
    assert got.bad_words_token_ids == [[3, 4]] and got.needs_output_tokens


def test_bitmask_kernel_matches_the_torch_reference() -> None:
    from pagedllm.sample.token_constraints import apply_bitmask, apply_bitmask_

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=g)
    mask = torch.randint(-2**31, 2**31 - 1, (5, 32), dtype=torch.int32, generator=g)
    ref = apply_bitmask(logits, mask, torch.arange(5))
    got = logits.clone()
    apply_bitmask_(got, mask)
    assert torch.equal(got, ref)
