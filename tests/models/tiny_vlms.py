"""Tiny random vision-language checkpoints, built offline by transformers and saved with a
working processor (image processor + tokenizer with the image token + chat template).

``build_llava(path)`` writes a LLaVA (CLIP ViT 30x30 / patch 6 -> 25 image tokens, a
2-layer Llama; ``variant="siglip"``: a SigLIP tower and a Qwen2 decoder) and returns the
HF model (fp32, eval).  The tokenizer is a word-level one
built with ``tokenizers`` (no downloads); every weight is random, so a weight loaded into
the wrong place changes the logits.  ``images()`` gives synthetic PIL images.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image

IMAGE_SIZE, PATCH = 30, 6
WORDS = ("the a an is are was of to in on and or what where who how why this that it "
         "describe image picture photo color red green blue cat dog sky tree house car "
         "big small one two three see look tell me about please user assistant hello "
         "world yes no , . ? ! : answer question short long").split()
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} :"
    "{% if m['content'] is string %} {{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %} {{ p['text'] }}{% else %} <image>{% endif %}"
    "{% endfor %}{% endif %} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}")


def make_tokenizer() -> Any:
    """A word-level fast tokenizer: specials, then ``WORDS`` (unknown words -> <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + list(WORDS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<pad>", extra_special_tokens={"image_token": "<image>"})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def llava_config(vocab_size: int, image_token_id: int, variant: str = "clip") -> Any:
    """``variant``: "clip" (CLIP tower, layer -2, CLS dropped, Llama decoder) or
    "siglip" (SigLIP tower, last layer, every patch, Qwen2 decoder with q/k/v bias)."""
    text_kw: dict[str, Any] = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=3)
    vision_kw: dict[str, Any] = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH)
    if variant == "siglip":
        vision = transformers.SiglipVisionConfig(**vision_kw)
        text = transformers.Qwen2Config(**text_kw)
        layer, strategy = -1, "full"
    else:
        vision = transformers.CLIPVisionConfig(**vision_kw, projection_dim=32)
        text = transformers.LlamaConfig(**text_kw)
        layer, strategy = -2, "default"
    return transformers.LlavaConfig(
        vision_config=vision.to_dict(), text_config=text.to_dict(),
        image_token_id=image_token_id, image_seq_length=(IMAGE_SIZE // PATCH) ** 2,
        vision_feature_layer=layer, vision_feature_select_strategy=strategy,
        architectures=["LlavaForConditionalGeneration"], pad_token_id=3)


def build_llava(path: str, seed: int = 0, variant: str = "clip") -> Any:
    """Save a tiny random LLaVA with its processor under ``path``; returns the HF model."""
    tok = make_tokenizer()
    image_token_id = tok.convert_tokens_to_ids("<image>")
    cfg = llava_config(len(tok), image_token_id, variant)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # every weight random (norms and biases too)
        for p in model.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    if variant == "siglip":
        image_processor = transformers.SiglipImageProcessor(
            size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    else:
        image_processor = transformers.CLIPImageProcessor(
            size={"shortest_edge": IMAGE_SIZE},
            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=PATCH,
        vision_feature_select_strategy=cfg.vision_feature_select_strategy,
        chat_template=CHAT_TEMPLATE, num_additional_image_tokens=int(variant == "clip"))
    processor.save_pretrained(path)
    return model


def image(seed: int, size: tuple[int, int] = (40, 34)) -> Image.Image:
    """A synthetic RGB image (a coloured wave plus noise; distinct per seed)."""
    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    fx, fy = rng.uniform(0.05, 0.5, 2)
    phase = rng.uniform(0, 6.3, 3)
    base = np.stack([127 + 120 * np.sin(fx * xx + fy * yy + ph) for ph in phase], -1)
    arr = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(arr, "RGB")


def hf_generate(model: Any, processor: Any, prompt: str, images: list[Image.Image],
                max_new_tokens: int) -> list[int]:
    """transformers' greedy tokens for ``prompt`` with ``images`` (fp32, CPU)."""
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=3)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
