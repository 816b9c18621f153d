"""Tiny random Qwen2-VL and Qwen2.5-VL checkpoints, built offline by transformers and saved
with a working processor (``Qwen2VLImageProcessor`` + a word-level tokenizer carrying the
family's ``<|vision_start|>``/``<|image_pad|>``/``<|vision_end|>`` tokens + a chat template).

Patches of 4 pixels (temporal patch 2, 2x2 merge) and a pixel range of 8x8..40x40, so an
image is a handful of tokens and its grid follows its size (dynamic resolution): 40x34 ->
grid 1x10x8 -> 20 tokens, 24x16 -> 1x6x4 -> 6 tokens.  The 2.5 tower has a window of 16
pixels (2x2 merged units) on block 0 and full attention on block 1
(``fullatt_block_indexes``), so window reordering and uneven edge windows are exercised.
Text: 2 layers, hidden 64, head_dim 16, ``mrope_section`` [2, 3, 3].  Every weight is
random, so a weight loaded into the wrong place changes the logits.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from PIL import Image

from pagedllm.multimodal.hf_processor import _images_only
from tests.models.tiny_vlms import WORDS, image

PATCH, MERGE = 4, 2
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|vision_start|>", "<|image_pad|>",
            "<|vision_end|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} :"
    "{% if m['content'] is string %} {{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %} {{ p['text'] }}"
    "{% else %} <|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}{% endif %} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}")
IMG = "<|vision_start|><|image_pad|><|vision_end|>"

__all__ = ["build_qwen2_vl", "build_qwen2_5_vl", "hf_generate", "image", "IMG"]


def make_tokenizer() -> Any:
    """A word-level fast tokenizer: specials (the vision tokens as added special tokens, so
    runs of them need no spaces), then ``WORDS``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + list(WORDS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<|image_pad|>",
                              "video_token": "<|video_pad|>",
                              "vision_start_token": "<|vision_start|>",
                              "vision_end_token": "<|vision_end|>"})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _text(vocab_size: int) -> dict[str, Any]:
    return dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
                eos_token_id=2, pad_token_id=3,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 3, 3]})


def _ids(tok: Any) -> dict[str, int]:
    c = tok.convert_tokens_to_ids
    return dict(image_token_id=c("<|image_pad|>"), video_token_id=c("<|video_pad|>"),
                vision_start_token_id=c("<|vision_start|>"),
                vision_end_token_id=c("<|vision_end|>"))


def qwen2_vl_config(tok: Any) -> Any:
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2,
                  patch_size=PATCH, temporal_patch_size=2, spatial_merge_size=MERGE,
                  hidden_act="quick_gelu")
    return transformers.Qwen2VLConfig(
        vision_config=vision, text_config=_text(len(tok)), **_ids(tok),
        architectures=["Qwen2VLForConditionalGeneration"], pad_token_id=3)


def qwen2_5_vl_config(tok: Any) -> Any:
    vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=48,
                  num_heads=4, patch_size=PATCH, temporal_patch_size=2,
                  spatial_merge_size=MERGE, window_size=16, fullatt_block_indexes=[1],
                  hidden_act="silu")
    return transformers.Qwen2_5_VLConfig(
        vision_config=vision, text_config=_text(len(tok)), **_ids(tok),
        architectures=["Qwen2_5_VLForConditionalGeneration"], pad_token_id=3)


def _build(path: str, cfg: Any, model_cls: Any, processor_cls: Any, tok: Any,
           seed: int) -> Any:
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # every weight random (norms and biases too)
        for p in model.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    image_processor = transformers.Qwen2VLImageProcessor(
        size={"shortest_edge": 8 * 8, "longest_edge": 40 * 40}, patch_size=PATCH,
        temporal_patch_size=2, merge_size=MERGE)
    # Without its video processor (transformers' needs torchvision): as the engine
    # loads it (pagedllm/multimodal/hf_processor.py).
    processor = _images_only(processor_cls)(image_processor=image_processor, tokenizer=tok,
                                            chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    return model


def build_qwen2_vl(path: str, seed: int = 0) -> Any:
    """Save a tiny random Qwen2-VL with its processor under ``path``; the HF model."""
    tok = make_tokenizer()
    return _build(path, qwen2_vl_config(tok), transformers.Qwen2VLForConditionalGeneration,
                  transformers.Qwen2VLProcessor, tok, seed)


def build_qwen2_5_vl(path: str, seed: int = 0) -> Any:
    """Save a tiny random Qwen2.5-VL with its processor under ``path``; the HF model."""
    tok = make_tokenizer()
    return _build(path, qwen2_5_vl_config(tok),
                  transformers.Qwen2_5_VLForConditionalGeneration,
                  transformers.Qwen2_5_VLProcessor, tok, seed)


def hf_generate(model: Any, processor: Any, prompt: str, images: list[Image.Image],
                max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens for ``prompt`` with ``images`` (fp32, CPU)."""
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=3)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
