"""Qwen2-VL and Qwen2.5-VL end to end through the offline API: greedy tokens equal
transformers' (fp32, CPU) token for token -- one image, two images of different sizes
(dynamic resolution: different grids and token counts), text only, image requests
batched with text ones, chunked prefill splitting an image's placeholder run, and
preempted equals not.  M-RoPE positions are checked against transformers'
``get_rope_index`` directly, and the decode positions through the tokens after them.

Checkpoints: tiny random models built and saved by transformers
(``tests/models/tiny_qwen_vl.py``: patch 4, 2x2 merge, 2-block towers, the 2.5 one with a
window block and a full block; 2-layer Qwen2 decoders with mrope_section [2, 3, 3]).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.multimodal.hf_processor import load_hf_processor
from tests.models.tiny_qwen_vl import IMG, build_qwen2_5_vl, build_qwen2_vl, hf_generate, image
from tests.models.vlm_greedy import MAX, greedy, run
from tests.models.vlm_greedy import expected as _expected

PROMPT = f"user : {IMG} describe the image </s> assistant :"
TWO = f"user : {IMG} and {IMG} what is the color ? </s> assistant :"
TEXT = "user : tell me about the cat </s> assistant :"
SMALL = (24, 16)  # 6 tokens; image() defaults to 40x34 -> 20 tokens


def expected(ckpt, prompt: str, images: list, n: int = MAX) -> list[int]:
    return _expected(hf_generate, ckpt, prompt, images, n)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def ckpt(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    model = (build_qwen2_vl if request.param == "qwen2_vl" else build_qwen2_5_vl)(path)
    return path, model, load_hf_processor(path)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt[0], kv_cache_memory_bytes=4 << 20, max_model_len=256,
               max_num_batched_tokens=128, limit_mm_per_prompt={"image": 2})


def test_positions_equal_get_rope_index(ckpt, llm):
    _, model, processor = ckpt
    ims = [image(1), image(2, SMALL)]
    inputs = processor(text=TWO, images=ims, return_tensors="pt")
    want, delta = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                             inputs["image_grid_thw"])
    _, ids, _, reqs = llm.llm_engine.input_processor.process(
        "x", {"prompt": TWO, "multi_modal_data": {"image": ims}}, greedy())
    ours = llm.llm_engine.client.core.executor.worker.runner.model
    pos, d = ours.get_mrope_input_positions(reqs[0].prompt_token_ids, reqs[0].mm_features)
    assert np.array_equal(pos, want[:, 0].numpy()) and d == int(delta)
    assert [f.length for f in reqs[0].mm_features] == [20, 6]


def test_one_two_and_no_image_equal_transformers(ckpt, llm):
    im1, im2 = image(1), image(2, SMALL)
    got = run(llm, [{"prompt": PROMPT, "multi_modal_data": {"image": im1}},
                    {"prompt": TWO, "multi_modal_data": {"image": [im1, im2]}},
                    {"prompt": TWO, "multi_modal_data": {"image": [im2, im1]}},
                    TEXT])
    assert got[0] == expected(ckpt, PROMPT, [im1])
    assert got[1] == expected(ckpt, TWO, [im1, im2])
    assert got[2] == expected(ckpt, TWO, [im2, im1])
    assert got[3] == expected(ckpt, TEXT, [])


def test_batched_with_text(ckpt, llm):
    im = image(6, (32, 40))
    outs = run(llm, [TEXT, {"prompt": PROMPT, "multi_modal_data": {"image": im}}, TEXT],
               greedy(12))
    assert outs[1] == expected(ckpt, PROMPT, [im], 12)
    assert outs[0] == outs[2] == expected(ckpt, TEXT, [], 12)


def test_same_image_prefix_hit_n_and_expanded_ids(ckpt, llm):
    """A second request with the same image starts past its cached blocks (mid-prompt
    M-RoPE rows); n = 2 forks share the parent's rows; expanded token ids equal text."""
    _, _, processor = ckpt
    im = image(5)
    want = expected(ckpt, PROMPT, [im])
    first = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": im}}, greedy(),
                         use_tqdm=False)[0]
    again = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": im.copy()}},
                         SamplingParams(temperature=0.0, max_tokens=MAX, ignore_eos=True,
                                        n=2), use_tqdm=False)[0]
    assert list(first.outputs[0].token_ids) == want
    assert [list(c.token_ids) for c in again.outputs] == [want, want]
    assert again.num_cached_tokens >= 16
    ims = [image(3), image(4, SMALL)]
    ids = processor(text=TWO, images=ims, return_tensors="np")["input_ids"][0]
    got = run(llm, [{"prompt_token_ids": [int(t) for t in ids],
                     "multi_modal_data": {"image": ims}}])
    assert got == [expected(ckpt, TWO, ims)]


def test_chat_content_parts(ckpt, llm):
    _, model, processor = ckpt
    im = image(7, (36, 28))
    q = {"type": "text", "text": "describe the image"}
    out = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": im},
                                                 q]}], greedy(), use_tqdm=False)
    text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       q]}],
                                         tokenize=False, add_generation_prompt=True)
    assert list(out[0].outputs[0].token_ids) == expected(ckpt, text, [im])


def test_chunked_prefill_splits_the_placeholder_run(ckpt):
    """An 8-token budget: the 20-token image run is computed over three steps, its
    M-RoPE rows sliced per chunk."""
    im1, im2 = image(1), image(2, SMALL)
    llm = LLM(ckpt[0], kv_cache_memory_bytes=4 << 20, max_model_len=256,
              max_num_batched_tokens=8, enable_prefix_caching=False)
    got = run(llm, [{"prompt": TWO, "multi_modal_data": {"image": [im1, im2]}},
                    {"prompt": PROMPT, "multi_modal_data": {"image": im2}}, TEXT])
    assert got == [expected(ckpt, TWO, [im1, im2]), expected(ckpt, PROMPT, [im2]),
                   expected(ckpt, TEXT, [])]


def test_preempted_equals_not(ckpt):
    """A pool of 12 blocks of 8 for 4 requests of up to 7 blocks each: recompute preemption
    resumes image requests at their M-RoPE positions (prompt rows + delta after)."""
    ims = [image(1), image(2, SMALL), image(3, (32, 24)), image(4)]
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in ims]
    n = 20
    llm = LLM(ckpt[0], kv_cache_memory_bytes=13 * 8 * 512, max_model_len=64,
              max_num_batched_tokens=64, block_size=8)
    got = run(llm, prompts, greedy(n))
    assert llm.llm_engine.client.core.scheduler.total_preemptions > 0
    assert got == [expected(ckpt, PROMPT, [im], n) for im in ims]


def test_vision_tower_equals_transformers(ckpt, llm):
    _, model, processor = ckpt
    ims = [image(3), image(4, SMALL)]
    inputs = processor(text=TWO, images=ims, return_tensors="pt")
    ours = llm.llm_engine.client.core.executor.worker.runner.model
    with torch.no_grad():
        want = model.model.get_image_features(inputs["pixel_values"],
                                              inputs["image_grid_thw"]).pooler_output
        got = ours.embed_multimodal({"pixel_values": inputs["pixel_values"],
                                     "image_grid_thw": inputs["image_grid_thw"]})
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
