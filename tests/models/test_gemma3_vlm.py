"""Gemma 3 with images end to end through the offline API: greedy tokens equal
transformers' (fp32, CPU) token for token -- one image, two images, text only, batched
with text, a token budget smaller than an image run (the run stays whole), prefix-cache
hits with the same image, preempted equals not -- with transformers' bidirectional mask
over each image's tokens (on sliding layers too: the tiny model's window is 6).

The checkpoint is a tiny random Gemma 3 VLM built and saved by transformers
(``tests/models/tiny_gemma3.py``: SigLIP 28x28 / patch 7 pooled to 4 tokens per image,
a 4-layer decoder, 3 sliding : 1 global).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedllm import LLM
from tests.models.tiny_gemma3 import build_gemma3, hf_generate, image
from tests.models.vlm_greedy import MAX, greedy, run
from tests.models.vlm_greedy import expected as _expected

PROMPT = "<start_of_turn> user <start_of_image> describe the image <end_of_turn> " \
         "<start_of_turn> assistant"
TWO = "<start_of_turn> user <start_of_image> and <start_of_image> what is the color ? " \
      "<end_of_turn> <start_of_turn> assistant"
TEXT = "<start_of_turn> user tell me about the cat <end_of_turn> <start_of_turn> assistant"


def engine(llm: LLM):
    return llm.llm_engine.client.core


def expected(ckpt, prompt: str, images: list, n: int = MAX) -> list[int]:
    return _expected(hf_generate, ckpt, prompt, images, n)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_gemma3"))
    model = build_gemma3(path)
    processor = transformers.AutoProcessor.from_pretrained(path)
    return path, model, processor


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt[0], kv_cache_memory_bytes=4 << 20, max_model_len=256,
               max_num_batched_tokens=64, block_size=4)


def test_the_image_mask_matters(ckpt):
    """Guards the tests below: transformers without token_type_ids (plain causal) gives
    other tokens, and so do other images."""
    _, model, processor = ckpt
    inputs = processor(text=PROMPT, images=[image(1)], return_tensors="pt")
    inputs.pop("token_type_ids")
    with torch.no_grad():
        causal = model.generate(**inputs, max_new_tokens=MAX, do_sample=False,
                                pad_token_id=0)[0, inputs["input_ids"].shape[1]:].tolist()
    assert causal != expected(ckpt, PROMPT, [image(1)])
    assert expected(ckpt, PROMPT, [image(2)]) != expected(ckpt, PROMPT, [image(1)])


def test_one_two_and_no_image_batched_equal_transformers(ckpt, llm):
    im1, im2 = image(1), image(2)
    got = run(llm, [{"prompt": PROMPT, "multi_modal_data": {"image": im1}},
                    {"prompt": TWO, "multi_modal_data": {"image": [im1, im2]}},
                    TEXT])
    assert got[0] == expected(ckpt, PROMPT, [im1])
    assert got[1] == expected(ckpt, TWO, [im1, im2])
    assert got[2] == expected(ckpt, TEXT, [])


def test_same_image_hits_the_prefix_cache(ckpt, llm):
    """Block size 4: the second request's hit covers blocks holding part of the image's
    run (its 4 soft tokens start at position 4 after the text), then computes the rest."""
    im = image(5)
    want = expected(ckpt, PROMPT, [im])
    first = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": im}}, greedy(),
                         use_tqdm=False)[0]
    again = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": im.copy()}},
                         greedy(), use_tqdm=False)[0]
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids) == want
    assert again.num_cached_tokens >= 8  # blocks holding image tokens hit
    other = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image(6)}},
                         greedy(), use_tqdm=False)[0]
    assert list(other.outputs[0].token_ids) == expected(ckpt, PROMPT, [image(6)])
    assert other.num_cached_tokens <= 4  # only the text block before the image


def test_a_prefix_hit_ending_inside_an_image_run(ckpt, llm):
    """Block size 4, the run at positions 2..5: a second prompt with the same image and
    other text from position 7 on hits the first block only (positions 0..3: two of the
    run's tokens), then computes the rest of the run, whose queries see the cached keys
    of its first half and their own -- transformers' tokens all the same."""
    im = image(8)
    a = "<start_of_turn> <start_of_image> describe the image <end_of_turn> " \
        "<start_of_turn> assistant"
    b = "<start_of_turn> <start_of_image> what is this ? <end_of_turn> " \
        "<start_of_turn> assistant"
    outs = [llm.generate({"prompt": p, "multi_modal_data": {"image": im}}, greedy(),
                         use_tqdm=False)[0] for p in (a, b)]
    assert outs[1].prompt_token_ids[2:6] == [5] * 4  # the run (<image_soft_token> = 5)
    assert outs[1].num_cached_tokens == 4
    assert [list(o.outputs[0].token_ids) for o in outs] == \
        [expected(ckpt, a, [im]), expected(ckpt, b, [im])]


@pytest.mark.parametrize("budget,async_scheduling", [(5, False), (6, False), (6, True)])
def test_a_small_budget_never_splits_an_image_run(ckpt, budget, async_scheduling):
    """Token budgets of 5 and 6 cut prompts into chunks; a chunk that would end inside
    an image's 4-token run stops before it, and the outputs still equal transformers'
    (also with async scheduling: step N+1 scheduled before step N's tokens are read)."""
    im1, im2 = image(1), image(2)
    llm = LLM(ckpt[0], kv_cache_memory_bytes=4 << 20, max_model_len=256,
              max_num_batched_tokens=budget, enable_prefix_caching=False,
              async_scheduling=async_scheduling)
    sched = engine(llm).scheduler
    seen: list[tuple[int, int]] = []
    fit = sched.encoder.fit

    def spy(req, start, n):
        got = fit(req, start, n)
        for f in req.mm_features:
            if start < f.end and f.offset < start + got:  # the chunk meets this run
                assert f.end <= start + got, (f.offset, f.end, start, got)
                seen.append((start, start + got))
        return got

    sched.encoder.fit = spy
    got = run(llm, [{"prompt": TWO, "multi_modal_data": {"image": [im1, im2]}},
                    {"prompt": PROMPT, "multi_modal_data": {"image": im2}}, TEXT])
    assert got == [expected(ckpt, TWO, [im1, im2]), expected(ckpt, PROMPT, [im2]),
                   expected(ckpt, TEXT, [])]
    assert seen  # chunks met images
    assert sched.encoder.whole_runs


def test_a_run_longer_than_the_budget_is_refused(ckpt):
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(ckpt[0], kv_cache_memory_bytes=4 << 20, max_model_len=256,
            max_num_batched_tokens=3)


def test_preempted_equals_not(ckpt):
    """A KV pool too small for 4 image requests of 44 tokens at once: recompute
    preemption computes their runs (and encodes their images) again."""
    ims = [image(s) for s in (1, 2, 3, 4)]
    llm = LLM(ckpt[0], kv_cache_memory_bytes=60_000, max_model_len=48,
              max_num_batched_tokens=64, block_size=4)
    n = 30
    got = run(llm, [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in ims],
              greedy(n))
    assert engine(llm).scheduler.total_preemptions > 0
    assert got == [expected(ckpt, PROMPT, [im], n) for im in ims]


def test_chat_with_an_image(ckpt, llm):
    im = image(7)
    msgs = [{"role": "user", "content": [{"type": "image_pil", "image_pil": im},
                                         {"type": "text", "text": "describe the image"}]}]
    _, _, processor = ckpt
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"},
                                      {"type": "text", "text": "describe the image"}]}],
        add_generation_prompt=True, tokenize=False)
    out = llm.chat(msgs, greedy(), use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == expected(ckpt, prompt, [im])
