"""What the engine-level greedy tests compare against: four prompts sharing a 40-token
prefix (so a second pass is served from the prefix cache) and transformers' own greedy
``generate`` of each, unbatched, EOS ignored."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def shared_prefix_prompts(vocab: int, seed: int = 7,
                          tails: Sequence[int] = (5, 23, 12, 30)) -> list[list[int]]:
    """A 40-token prefix, then ``tails`` (5, 23, 12 and 30) further random tokens below
    ``vocab``, one prompt per tail."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (40,), generator=g).tolist()
    return [shared + torch.randint(0, vocab, (n,), generator=g).tolist() for n in tails]


def hf_greedy(hf: torch.nn.Module, prompts: list[list[int]], new: int) -> list[list[int]]:
    """``new`` greedy tokens of each prompt from transformers' ``generate``."""
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False,
                              top_p=None, top_k=None, temperature=None)
            out.append(ids[0, len(p):].tolist())
    return out
