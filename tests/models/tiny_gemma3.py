"""A tiny random Gemma 3 vision-language checkpoint, built offline by transformers and
saved with a working ``Gemma3Processor`` (``Gemma3ImageProcessor`` at 28x28 + a word-level
tokenizer with ``<start_of_image>`` / ``<image_soft_token>`` / ``<end_of_image>`` + a
chat template).

SigLIP 28x28 / patch 7 -> 16 patches, average-pooled to ``mm_tokens_per_image = 4``
soft tokens per image; a 4-layer Gemma 3 decoder (sliding, sliding, sliding, full) with a
sliding window of 6, short enough that a query inside an image run, which sees its whole
run (transformers' bidirectional image mask), still loses keys to the window.  Every
weight is random, so a weight loaded into the wrong place changes the logits; the LM head
is untied (tied to a random embedding scaled by sqrt(hidden), greedy decoding would only
repeat the last input token), so images and the image mask change the tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from tests.models.tiny_vlms import WORDS, hf_generate, image  # noqa: F401 (re-exported)

IMAGE_SIZE, PATCH, TOKENS_PER_IMAGE = 28, 7, 4
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_image>", "<image_soft_token>",
            "<end_of_image>", "<start_of_turn>", "<end_of_turn>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn> {{ m['role'] }}"
    "{% if m['content'] is string %} {{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'text' %} {{ p['text'] }}{% else %} <start_of_image>{% endif %}"
    "{% endfor %}{% endif %} <end_of_turn> {% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn> assistant{% endif %}")


def make_tokenizer() -> Any:
    """A word-level fast tokenizer: Gemma's specials, then ``WORDS``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS + list(WORDS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>",
        pad_token="<pad>", extra_special_tokens={
            "boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
            "eoi_token": "<end_of_image>"})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def gemma3_config(tok: Any, sliding_window: int = 6) -> Any:
    ids = tok.convert_tokens_to_ids
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        query_pre_attn_scalar=16, max_position_embeddings=512, rms_norm_eps=1e-6,
        sliding_window=sliding_window,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        bos_token_id=2, eos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        image_size=IMAGE_SIZE, patch_size=PATCH, vision_use_head=False)
    return transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(),
        mm_tokens_per_image=TOKENS_PER_IMAGE, boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"), image_token_index=ids("<image_soft_token>"),
        architectures=["Gemma3ForConditionalGeneration"], tie_word_embeddings=False)


def build_gemma3(path: str, seed: int = 0, sliding_window: int = 6) -> Any:
    """Save a tiny random Gemma 3 VLM with its processor under ``path``; returns the HF
    model (fp32, eval, eager attention: the bidirectional image mask as transformers
    builds it)."""
    tok = make_tokenizer()
    cfg = gemma3_config(tok, sliding_window)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # every weight random (norms and biases too)
        for p in model.parameters():
            p.normal_(0, 0.1) if p.dim() > 1 else p.uniform_(-0.5, 0.5)
    model.save_pretrained(path)
    image_processor = transformers.Gemma3ImageProcessor(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    processor = transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=tok, chat_template=CHAT_TEMPLATE,
        image_seq_length=TOKENS_PER_IMAGE)
    processor.save_pretrained(path)
    return model
