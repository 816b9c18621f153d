"""A working processor for a dummy-weight vision-language shape, built offline.

The engine runs the checkpoint's own processor in the front end for every image request
(``multimodal/processor.py``), even when the prompt is token ids, so a dummy VLM
directory needs one beside its ``config.json``.  No hub: the image processor is built
from the vision config (patch, temporal patch, merge size; the family's pixel range), and
the tokenizer is a word-level stand-in with the family's vocabulary size and its special
tokens at their real ids::

    ids 0 .. first_special - 1     "<unk>", "t1", "t2", ...   (meaningless words)
    ids first_special ..           <|endoftext|> <|im_start|> <|im_end|> ...
                                   <|vision_start|> <|vision_end|> <|image_pad|> ...

Text ids mean nothing (the weights are random); what matters is that placeholder runs,
``image_grid_thw`` and the pixel tensors are exactly the real processor's.
"""

from __future__ import annotations

import os
from typing import Any

# Qwen2 / Qwen2.5 tokenizers: 151,643 regular tokens, then these at 151,643 onwards.
QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
    "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
QWEN_FIRST_SPECIAL = 151643
# Qwen2-VL's chat template, without its video and tool branches.
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'text' %}{{ content['text'] }}"
    "{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen2-VL / 2.5-VL image processors: 4 to 16,384 merged 28x28 units.
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 56 * 56, 28 * 28 * 16384


def qwen_tokenizer(vocab_size: int) -> Any:
    """The stand-in Qwen2.5 tokenizer (module doc): regular ids below 151,643 (or below
    ``vocab_size`` minus the specials for a smaller vocabulary), then the specials."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    first = min(QWEN_FIRST_SPECIAL, vocab_size - len(QWEN_SPECIALS))
    if first < 1:
        raise ValueError(f"vocab_size {vocab_size} has no room for the Qwen specials")
    vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, first)}}
    vocab.update({t: first + i for i, t in enumerate(QWEN_SPECIALS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(QWEN_SPECIALS)  # already in the vocabulary: ids unchanged
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token=None, eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image_pad|>",
                              "video_token": "<|video_pad|>",
                              "vision_start_token": "<|vision_start|>",
                              "vision_end_token": "<|vision_end|>"})
    fast.chat_template = QWEN_VL_CHAT_TEMPLATE
    return fast


def check_token_ids(tok: Any, cfg: dict[str, Any]) -> None:
    """``ValueError`` unless the tokenizer's specials sit at the config's ids."""
    for key, token in (("image_token_id", "<|image_pad|>"),
                       ("vision_start_token_id", "<|vision_start|>"),
                       ("vision_end_token_id", "<|vision_end|>")):
        if key in cfg and tok.convert_tokens_to_ids(token) != cfg[key]:
            raise ValueError(f"dummy processor: {token} has id "
                             f"{tok.convert_tokens_to_ids(token)}, the config's {key} is "
                             f"{cfg[key]}")


def write_dummy_processor(directory: str, cfg: dict[str, Any]) -> None:
    """Save a processor for the VLM config ``cfg`` into ``directory`` (Qwen2-VL and
    Qwen2.5-VL; ``ValueError`` for another family)."""
    import transformers

    from pagedllm.multimodal.hf_processor import _images_only

    arch = (cfg.get("architectures") or [""])[0]
    classes = {"Qwen2_5_VLForConditionalGeneration": transformers.Qwen2_5_VLProcessor,
               "Qwen2VLForConditionalGeneration": transformers.Qwen2VLProcessor}
    if arch not in classes:
        raise ValueError(f"dummy processor: no offline processor for {arch!r} "
                         f"(supported: {', '.join(classes)})")
    vision = cfg["vision_config"]
    tok = qwen_tokenizer(int(cfg.get("vocab_size") or cfg["text_config"]["vocab_size"]))
    check_token_ids(tok, cfg)
    image_processor = transformers.Qwen2VLImageProcessor(
        size={"shortest_edge": QWEN_MIN_PIXELS, "longest_edge": QWEN_MAX_PIXELS},
        patch_size=vision["patch_size"], temporal_patch_size=vision["temporal_patch_size"],
        merge_size=vision["spatial_merge_size"])
    # Without the video processor (transformers' needs torchvision), as the engine loads
    # it (multimodal/hf_processor.py).
    processor = _images_only(classes[arch])(image_processor=image_processor, tokenizer=tok,
                                            chat_template=QWEN_VL_CHAT_TEMPLATE)
    processor.save_pretrained(directory)
    if not os.path.exists(os.path.join(directory, "tokenizer.json")):
        raise RuntimeError(f"dummy processor: no tokenizer.json written to {directory}")
