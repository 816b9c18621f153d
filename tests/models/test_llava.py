"""LLaVA end to end through the offline API: greedy tokens equal transformers' (fp32, CPU)
token for token -- one image, two images, text only, batched with text, chunked prefill
splitting an image's placeholder run, prefix-cache and encoder-cache hits, two images
that must not collide, recompute and swap preemption, n > 1, beam search, chat content
parts -- and bad inputs rejected
with a ValueError naming the field while the engine stays usable.

The checkpoint is a tiny random LLaVA built and saved by transformers
(``tests/models/tiny_vlms.py``: CLIP 30x30 / patch 6 -> 25 image tokens, 2-layer Llama).
"""

from __future__ import annotations

import base64
import io

import msgspec
import pytest
import torch
import transformers

from pagedllm import LLM
from pagedllm.beam_search import BeamSearchParams
from pagedllm.messages import EngineCoreRequest
from tests.models.tiny_vlms import build_llava, hf_generate, image, llava_config, make_tokenizer
from tests.models.vlm_greedy import MAX, greedy, run
from tests.models.vlm_greedy import expected as _expected

PROMPT = "user : <image> describe the image </s> assistant :"
TWO = "user : <image> and <image> what is the color ? </s> assistant :"
TEXT = "user : tell me about the cat </s> assistant :"


def runner(llm: LLM):
    return llm.llm_engine.client.core.executor.worker.runner


def expected(ckpt, prompt: str, images: list, n: int = MAX) -> list[int]:
    return _expected(hf_generate, ckpt, prompt, images, n)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_llava"))
    model = build_llava(path)
    processor = transformers.AutoProcessor.from_pretrained(path)
    return path, model, processor


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt[0], kv_cache_memory_bytes=4 << 20, max_model_len=256,
               max_num_batched_tokens=128, limit_mm_per_prompt={"image": 2})


def test_one_two_and_no_image_equal_transformers(ckpt, llm):
    im1, im2 = image(1), image(2)
    got = run(llm, [{"prompt": PROMPT, "multi_modal_data": {"image": im1}},
                    {"prompt": TWO, "multi_modal_data": {"image": [im1, im2]}},
                    TEXT,
                    {"prompt": TEXT}])
    assert got[0] == expected(ckpt, PROMPT, [im1])
    assert got[1] == expected(ckpt, TWO, [im1, im2])
    assert got[2] == got[3] == expected(ckpt, TEXT, [])


def test_adjacent_images(ckpt, llm):
    """Two images with nothing between: one run of placeholders, split per image by the
    processor's token counts."""
    prompt = "user : <image> <image> what is this ? </s> assistant :"
    ims = [image(8), image(9)]
    _, ids, _, reqs = llm.llm_engine.input_processor.process(
        "adj", {"prompt": prompt, "multi_modal_data": {"image": ims}}, greedy())
    f0, f1 = reqs[0].mm_features
    assert (f0.length, f1.length, f1.offset) == (25, 25, f0.end)
    assert run(llm, [{"prompt": prompt, "multi_modal_data": {"image": ims}}]) == \
        [expected(ckpt, prompt, ims)]


def test_prompt_token_ids_with_expanded_placeholders(ckpt, llm):
    _, _, processor = ckpt
    im = image(3)
    ids = processor(text=TWO, images=[im, image(4)], return_tensors="np")["input_ids"][0]
    got = run(llm, [{"prompt_token_ids": [int(t) for t in ids],
                     "multi_modal_data": {"image": [im, image(4)]}}])
    assert got[0] == expected(ckpt, TWO, [im, image(4)])


def test_different_images_same_text_do_not_collide(ckpt, llm):
    """Sequentially, so the second request looks up the first's cached blocks: only the
    blocks before the image may hit."""
    a, b = image(1), image(2)
    want_a, want_b = expected(ckpt, PROMPT, [a]), expected(ckpt, PROMPT, [b])
    assert want_a != want_b  # the images matter to this model
    outs = []
    for im in (a, b):
        outs.append(llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": im}},
                                 greedy(), use_tqdm=False)[0])
    assert list(outs[0].outputs[0].token_ids) == want_a
    assert list(outs[1].outputs[0].token_ids) == want_b
    assert outs[1].num_cached_tokens == 0  # the image starts in the first block


def test_same_image_hits_prefix_and_encoder_cache(ckpt, llm):
    im = image(5)
    want = expected(ckpt, PROMPT, [im])
    mm = runner(llm).mm
    first = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": im}}, greedy(),
                         use_tqdm=False)[0]
    again = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": im.copy()}},
                         greedy(), use_tqdm=False)[0]
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids) == want
    assert again.num_cached_tokens >= 16  # the blocks holding the image hit
    # Two prompts (no common block) with the image in one step: encoded once, the
    # second an encoder-cache hit.
    other = "hello world " + PROMPT
    hits, encoded = mm.num_hits, mm.num_encoded
    got = run(llm, [{"prompt": p, "multi_modal_data": {"image": im}}
                    for p in ("user : what <image> is this ? </s> assistant :", other)])
    assert got == [expected(ckpt, "user : what <image> is this ? </s> assistant :", [im]),
                   expected(ckpt, other, [im])]
    assert mm.num_encoded - encoded == 1 and mm.num_hits - hits == 1
    assert not mm.outputs and not mm.holders  # released once the runs were computed


def test_batched_with_text_and_n_gt_1(ckpt, llm):
    im = image(6)
    want = expected(ckpt, PROMPT, [im])
    outs = llm.generate([TEXT, {"prompt": PROMPT, "multi_modal_data": {"image": im}}, TEXT],
                        greedy(), use_tqdm=False)
    assert list(outs[1].outputs[0].token_ids) == want
    assert list(outs[0].outputs[0].token_ids) == expected(ckpt, TEXT, [])
    two = llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": im}},
                       greedy(n=2), use_tqdm=False)[0]
    assert [list(c.token_ids) for c in two.outputs] == [want, want]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_splits_the_placeholder_run(ckpt, async_scheduling):
    """A 16-token budget: each 25-token image is encoded once (over the encoder budget,
    alone in its step) and its run computed over two or three steps; also with async
    scheduling (step N+1 scheduled before step N's tokens are read, as on CUDA)."""
    im1, im2 = image(1), image(2)
    llm = LLM(ckpt[0], kv_cache_memory_bytes=4 << 20, max_model_len=256,
              max_num_batched_tokens=16, enable_prefix_caching=False,
              async_scheduling=async_scheduling)
    got = run(llm, [{"prompt": TWO, "multi_modal_data": {"image": [im1, im2]}},
                    {"prompt": PROMPT, "multi_modal_data": {"image": im2}}, TEXT])
    assert got == [expected(ckpt, TWO, [im1, im2]), expected(ckpt, PROMPT, [im2]),
                   expected(ckpt, TEXT, [])]
    assert runner(llm).mm.num_encoded == 2  # im2 twice at once: one encoding


def test_preempted_equals_not(ckpt):
    """A KV pool of 10 blocks for 4 image requests of ~3 blocks each: recompute
    preemption re-encodes their images."""
    ims = [image(s) for s in (1, 2, 3, 4)]
    llm = LLM(ckpt[0], kv_cache_memory_bytes=10 * 16 * 512, max_model_len=64,
              max_num_batched_tokens=64, block_size=16)
    n = 24
    got = run(llm, [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in ims],
              greedy(n))
    assert llm.llm_engine.client.core.scheduler.total_preemptions > 0
    assert got == [expected(ckpt, PROMPT, [im], n) for im in ims]


def test_swap_preemption_and_beam_search(ckpt):
    ims = [image(s) for s in (1, 2, 3, 4)]
    llm = LLM(ckpt[0], kv_cache_memory_bytes=10 * 16 * 512, max_model_len=64,
              max_num_batched_tokens=64, preemption_mode="swap", swap_space=0.01)
    got = run(llm, [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in ims],
              greedy(24))
    assert llm.llm_engine.client.core.scheduler.total_preemptions > 0
    assert got == [expected(ckpt, PROMPT, [im], 24) for im in ims]

    _, model, processor = ckpt
    out = llm.beam_search([{"prompt": PROMPT, "multi_modal_data": {"image": ims[0]}}],
                          BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True))
    inputs = processor(text=PROMPT, images=[ims[0]], return_tensors="pt")
    with torch.no_grad():
        hf = model.generate(**inputs, max_new_tokens=6, num_beams=2, num_return_sequences=2,
                            do_sample=False, eos_token_id=None, pad_token_id=3)
    n = inputs["input_ids"].shape[1]
    assert [s.tokens[n:] for s in out[0].sequences] == hf[:, n:].tolist()


def test_chat_content_parts(ckpt, llm):
    im = image(7)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    q = {"type": "text", "text": "describe the image"}
    convs = [[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                           q]}],
             [{"role": "user", "content": [{"type": "image_pil", "image_pil": im}, q]}]]
    outs = llm.chat(convs, greedy(), use_tqdm=False)
    _, model, processor = ckpt
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, q]}], tokenize=False,
        add_generation_prompt=True)
    inputs = processor(text=text, images=[im], return_tensors="pt", add_special_tokens=False)
    want = model.generate(**inputs, max_new_tokens=MAX, do_sample=False, eos_token_id=None,
                          pad_token_id=3)[0, inputs["input_ids"].shape[1]:].tolist()
    assert [list(o.outputs[0].token_ids) for o in outs] == [want, want]


def test_bad_inputs_name_the_field_and_the_engine_stays_up(ckpt, llm):
    im = image(1)
    cases = [
        ({"prompt": PROMPT, "multi_modal_data": {"image": [im, im, im]}},
         "limit_mm_per_prompt"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": "cat.png"}}, "multi_modal_data"),
        ({"prompt": PROMPT, "multi_modal_data": {"video": [im]}}, "multi_modal_data"),
        ({"prompt": PROMPT, "multi_modal_data": {"image": [im, im]}}, "multi_modal_data"),
        ({"prompt": TEXT, "multi_modal_data": {"image": im}}, "multi_modal_data"),
    ]
    for prompt, field in cases:
        with pytest.raises(ValueError, match=field):
            llm.generate(prompt, greedy(), use_tqdm=False)
    bad_url = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(ValueError, match="image_url"):
        llm.chat(bad_url, greedy(), use_tqdm=False)
    assert run(llm, [{"prompt": PROMPT, "multi_modal_data": {"image": im}}]) == \
        [expected(ckpt, PROMPT, [im])]


def test_text_only_model_rejects_images(tmp_path):
    tok = make_tokenizer()
    cfg = llava_config(len(tok), 4).text_config
    cfg.architectures = ["LlamaForCausalLM"]
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), kv_cache_memory_bytes=1 << 20, max_model_len=128)
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image(1)}},
                     greedy(), use_tqdm=False)
    assert len(run(llm, [TEXT])[0]) == MAX


def test_features_cross_the_process_boundary(ckpt, llm):
    """The core request, images included, survives msgpack (the ZeroMQ transport)."""
    ip = llm.llm_engine.input_processor
    _, ids, _, reqs = ip.process("x", {"prompt": TWO, "multi_modal_data": {
        "image": [image(1), image(2)]}}, greedy())
    req = reqs[0]
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(req), type=EngineCoreRequest)
    assert back.mm_features == req.mm_features and len(req.mm_features) == 2
    f0, f1 = req.mm_features
    assert f0.identifier != f1.identifier and f0.length == f1.length == 25
    assert ids[f0.offset:f0.end] == [4] * 25 and f1.offset >= f0.end
    assert f0.data["pixel_values"].to_numpy().shape == (3, 30, 30)


def test_siglip_tower_with_a_qwen2_decoder(tmp_path):
    """LLaVA's other shapes: a SigLIP tower (no class token, "full" features of the last
    layer) and a Qwen2 decoder (q/k/v bias)."""
    model = build_llava(str(tmp_path), seed=1, variant="siglip")
    processor = transformers.AutoProcessor.from_pretrained(str(tmp_path))
    llm = LLM(str(tmp_path), kv_cache_memory_bytes=2 << 20, max_model_len=256,
              max_num_batched_tokens=16)
    ims = [image(1), image(2)]
    got = run(llm, [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in ims]
              + [{"prompt": TWO, "multi_modal_data": {"image": ims}}])
    assert got == [hf_generate(model, processor, PROMPT, [im], MAX) for im in ims] + [
        hf_generate(model, processor, TWO, ims, MAX)]
