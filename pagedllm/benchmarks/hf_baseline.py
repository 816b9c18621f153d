"""The Hugging Face Transformers ``generate()`` baseline, run on the same requests as
pagedllm in the same process (static batches, left padding, EOS ignored)."""

from __future__ import annotations

import time
from typing import Any

import torch

from pagedllm.config import ModelConfig


def load_hf_model(model_config: ModelConfig, device: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    r = model_config.resolved
    if model_config.load_format == "dummy":
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(model_config.hf_config, dtype=dtype)
    elif r.gguf_file:
        model = AutoModelForCausalLM.from_pretrained(r.directory, gguf_file=r.gguf_file,
                                                     dtype=dtype).to(device)
    else:
        model = AutoModelForCausalLM.from_pretrained(r.directory, dtype=dtype).to(device)
    return model.eval()


@torch.inference_mode()
def hf_generate(model: Any, prompts: list[list[int]], output_lens: list[int],
                batch_size: int, pad_token_id: int = 0) -> tuple[float, int]:
    """Generate in static batches of ``batch_size`` (left padded); each batch runs to the
    longest ``output_len`` in it.  Returns (seconds, useful output tokens)."""
    device = next(model.parameters()).device
    t0 = time.perf_counter()
    useful = 0
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        olen = max(output_lens[i:i + batch_size])
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for j, p in enumerate(chunk):
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                       max_new_tokens=olen, min_new_tokens=olen, do_sample=False,
                       pad_token_id=pad_token_id, top_p=None, top_k=None, temperature=None)
        useful += sum(output_lens[i:i + batch_size])
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, useful
