"""Shared helpers of the integer-checkpoint tests: load a checkpoint directory with
pagedllm (whole, or stopping before the post-load repack), and greedy decoding through
the paged KV cache, batched or one request at a time."""

from __future__ import annotations

import torch
import transformers

from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization.int_layout import IntWeight
from pagedllm.models.loader import iter_safetensors, load_model, make_quant_config
from pagedllm.models.registry import get_model_class
from tests.models.paged import PagedSession

PROMPTS = [[1, 5, 9, 33, 2, 8, 100, 7, 64], [3, 4, 150, 11], [17, 18, 19, 20, 21, 22],
           [99, 1, 42], [120, 7, 7, 7, 80, 13, 2], [55, 66, 77, 88]]
NEW_TOKENS = 8


def engine_config(path: str, **kw):  # type: ignore[no-untyped-def]
    return EngineArgs(model=path, device="cpu", dtype="float32", **kw).create_engine_config()


def load(path: str, **kw) -> tuple[torch.nn.Module, object]:
    cfg = engine_config(path, **kw)
    return load_model(cfg.model_config, torch.device("cpu"), TorchReferenceBackend()), cfg


def loaded_int_weights(path: str) -> dict[str, IntWeight]:
    """Every quantised linear layer's weight in the canonical layout, straight after the
    real loader has sharded the checkpoint into it (before the CPU repack):
    ``{layer prefix: IntWeight}``."""
    mc = engine_config(path).model_config
    qc = make_quant_config(mc, torch.device("cpu"))
    with torch.device("cpu"):
        model = get_model_class(mc.hf_config)(mc.hf_config, TorchReferenceBackend(), qc)
    model.load_weights(iter_safetensors(mc.resolved.directory))
    return {m.prefix: m.quant_method.to_int_weight(m) for m in model.modules()
            if isinstance(m, LinearBase) and hasattr(m.quant_method, "to_int_weight")}


def fused_reference(ref: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The reference weight of a (possibly fused) layer: its parts stacked on N."""
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")),
                         ("gate_up_proj", ("gate_proj", "up_proj"))):
        if prefix.endswith(fused):
            base = prefix[:-len(fused)]
            return torch.cat([ref[base + p] for p in parts])
    return ref[prefix]


def greedy(model: torch.nn.Module, cfg, prompts: list[list[int]],  # type: ignore[no-untyped-def]
           batched: bool = True, n_new: int = NEW_TOKENS) -> list[list[int]]:
    """Greedy continuations through the paged KV cache: all requests in each step, or
    (``batched=False``) each request alone."""
    mc = cfg.model_config
    if not batched:  # one session per request: nothing shared but the weights
        return [greedy(model, cfg, [p], True, n_new)[0] for p in prompts]
    s = PagedSession(model, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks=48)
    out: list[list[int]] = [[] for _ in prompts]
    step = {i: p for i, p in enumerate(prompts)}
    for _ in range(n_new):
        logits = s.step(step, last_only=True)
        step = {}
        for i in range(len(prompts)):
            tok = int(logits[i][-1].argmax())
            out[i].append(tok)
            step[i] = [tok]
    return out


def hf_greedy(hf: transformers.PreTrainedModel, prompts: list[list[int]],
              n_new: int = NEW_TOKENS) -> list[list[int]]:
    """Transformers' greedy continuations: argmax of its forward over the whole
    sequence, ``n_new`` times (``generate``'s greedy search without its per-call set-up
    cost; EOS is not special, as in ``greedy``)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(n_new):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    return out


def matching(a: list[list[int]], b: list[list[int]]) -> int:
    """How many prompts' continuations agree token for token."""
    return sum(x == y for x, y in zip(a, b))


def near_tie_divergences(ours: list[list[int]], ref: list[list[int]],
                         hf: transformers.PreTrainedModel, prompts: list[list[int]],
                         tie: float) -> tuple[int, list[tuple[int, int, float]]]:
    """``(exact, real)``: how many prompts match token for token, and the divergences
    that are *not* near-ties: ``(prompt, position, margin)`` where transformers' logit
    of its token exceeds its logit of ours by ``tie`` or more at the first divergence
    (transformers' own logits, on its own prefix)."""
    exact, real = 0, []
    for i, (x, y) in enumerate(zip(ours, ref)):
        if x == y:
            exact += 1
            continue
        j = next(t for t in range(len(x)) if x[t] != y[t])
        with torch.no_grad():
            logits = hf(torch.tensor([prompts[i] + y[:j]])).logits[0, -1].float()
        margin = float(logits[y[j]] - logits[x[j]])
        if margin >= tie:
            real.append((i, j, margin))
    return exact, real
