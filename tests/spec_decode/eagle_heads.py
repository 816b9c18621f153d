"""Tiny EAGLE / EAGLE-3 head checkpoints in the published layouts (no library writes
them: safetensors.torch.save_file with the published key names), for tiny random Llama
targets from transformers, and a straightforward torch reference of the heads' math
(full causal attention over the whole sequence, recomputed every step; no paging)."""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers
from safetensors.torch import save_file

SMALL: dict[str, Any] = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=256,
                             architectures=["LlamaForCausalLM"])


def tiny_target(path: str, vocab: int, layers: int, seed: int = 0,
                scale: float = 4.0) -> transformers.LlamaForCausalLM:
    """A random Llama saved to ``path``; weights scaled up (sharp logits: no near-ties)."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, num_hidden_layers=layers, **SMALL)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(scale if p.dim() == 2 else 1.0)
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def _layer(h: int, q_in: int, inter: int, heads: int, kv: int, g: torch.Generator,
           norms: tuple[str, ...]) -> dict[str, torch.Tensor]:
    d = h // heads

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * (2.0 / shape[-1] ** 0.5)

    out = {"self_attn.q_proj.weight": w(heads * d, q_in),
           "self_attn.k_proj.weight": w(kv * d, q_in),
           "self_attn.v_proj.weight": w(kv * d, q_in),
           "self_attn.o_proj.weight": w(h, heads * d),
           "mlp.gate_proj.weight": w(inter, h), "mlp.up_proj.weight": w(inter, h),
           "mlp.down_proj.weight": w(h, inter)}
    for n in norms:
        out[f"{n}.weight"] = 1.0 + 0.2 * torch.randn(h, generator=g)
    return out


def write_head(path: str, method: str, target_cfg: Any, seed: int = 1, *,
               draft_vocab: int | None = None, fc_bias: bool = True,
               fc_in: int | None = None, fmt: str = "safetensors") -> dict[str, torch.Tensor]:
    """A random ``method`` head for ``target_cfg`` at ``path`` (config.json + one
    safetensors file in the published names, or with ``fmt="bin"`` the published heads'
    ``pytorch_model.bin``); returns its tensors.  ``fc_in``: a wrong fc in-dim (for the
    error tests)."""
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    h, v = target_cfg.hidden_size, target_cfg.vocab_size
    inter, heads, kv = SMALL["intermediate_size"], SMALL["num_attention_heads"], \
        SMALL["num_key_value_heads"]
    extra: dict[str, Any] = {}
    t: dict[str, torch.Tensor] = {}
    if method == "eagle":
        t["fc.weight"] = torch.randn(h, fc_in or 2 * h, generator=g) / (2 * h) ** 0.5
        if fc_bias:
            t["fc.bias"] = 0.1 * torch.randn(h, generator=g)
        # EAGLE-1 checkpoints may carry an input_layernorm and embeddings: both unused.
        t.update({f"layers.0.{k}": x for k, x in _layer(
            h, h, inter, heads, kv, g, ("input_layernorm", "post_attention_layernorm")
        ).items()})
        t["embed_tokens.weight"] = torch.randn(v, h, generator=g)
    else:
        dv = draft_vocab or v
        t["fc.weight"] = torch.randn(h, fc_in or 3 * h, generator=g) / (3 * h) ** 0.5
        t.update({f"midlayer.{k}": x for k, x in _layer(
            h, 2 * h, inter, heads, kv, g,
            ("input_layernorm", "hidden_norm", "post_attention_layernorm")).items()})
        t["norm.weight"] = 1.0 + 0.2 * torch.randn(h, generator=g)
        t["lm_head.weight"] = torch.randn(dv, h, generator=g) * 0.5
        # Draft ids -> target ids: a sorted random subset of the vocabulary.
        keep = torch.randperm(v, generator=g)[:dv].sort().values
        t["d2t"] = keep - torch.arange(dv)
        t2d = torch.zeros(v, dtype=torch.bool)
        t2d[keep] = True
        t["t2d"] = t2d
        extra = dict(draft_vocab_size=dv, architectures=["LlamaForCausalLMEagle3"])
    # A context shorter than the target's, as published EAGLE-3 heads have (2048).
    cfg = transformers.LlamaConfig(vocab_size=v, num_hidden_layers=1,
                                   **{**SMALL, "max_position_embeddings": 16, **extra})
    cfg.save_pretrained(path)
    if fmt == "bin":
        torch.save({k: x.contiguous() for k, x in t.items()},
                   os.path.join(path, "pytorch_model.bin"))
    else:
        save_file({k: x.contiguous() for k, x in t.items()},
                  os.path.join(path, "model.safetensors"))
    return t


# -- the reference --------------------------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos[:, None].float() * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def _attention(x: torch.Tensor, w: dict[str, torch.Tensor], pre: str, cfg: Any
               ) -> torch.Tensor:
    t = x.shape[0]
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // heads
    pos = torch.arange(t)
    theta = cfg.rope_parameters["rope_theta"]
    q = _rope((x @ w[f"{pre}q_proj.weight"].T).view(t, heads, d), pos, theta)
    k = _rope((x @ w[f"{pre}k_proj.weight"].T).view(t, kv, d), pos, theta)
    v = (x @ w[f"{pre}v_proj.weight"].T).view(t, kv, d)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(t, heads * d)
    return o @ w[f"{pre}o_proj.weight"].T


def _mlp(x: torch.Tensor, w: dict[str, torch.Tensor], pre: str) -> torch.Tensor:
    gate = x @ w[f"{pre}gate_proj.weight"].T
    return (torch.nn.functional.silu(gate) * (x @ w[f"{pre}up_proj.weight"].T)) \
        @ w[f"{pre}down_proj.weight"].T


def target_states(method: str, hf: Any, tokens: list[int]) -> torch.Tensor:
    """The target's per-position states a head reads: the final-norm output (EAGLE-1), or
    the residual stream entering layers 2, L // 2, L - 3 side by side (EAGLE-3)."""
    with torch.no_grad():
        hs = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    n = hf.config.num_hidden_layers
    if method == "eagle":
        return hs[n][0]
    return torch.cat([hs[2][0], hs[n // 2][0], hs[n - 3][0]], -1)


def reference_drafts(method: str, w: dict[str, torch.Tensor], hf: Any,
                     tokens: list[int], k: int) -> list[int]:
    """The head's ``k`` greedy drafts after ``tokens``, from scratch: position p's input
    is (tokens[p + 1], the target's state at p); each draft step appends (draft, the
    head's own output state) and reruns the head over the whole sequence."""
    cfg, eps = hf.config, hf.config.rms_norm_eps
    emb = hf.model.embed_tokens.weight.detach()
    states = target_states(method, hf, tokens)[:len(tokens) - 1]
    if method == "eagle3":
        states = states @ w["fc.weight"].T
    ids = list(tokens[1:])
    hid = list(states)
    drafts: list[int] = []
    with torch.no_grad():
        for _ in range(k):
            e = emb[torch.tensor(ids)]
            hx = torch.stack(hid)
            if method == "eagle":
                x = torch.cat([e, hx], -1) @ w["fc.weight"].T
                if "fc.bias" in w:
                    x = x + w["fc.bias"]
                r = x + _attention(x, w, "layers.0.self_attn.", cfg)
                g = r + _mlp(_rms(r, w["layers.0.post_attention_layernorm.weight"], eps),
                             w, "layers.0.mlp.")
                logits = g @ hf.lm_head.weight.detach().T
                tok = int(logits[-1].argmax())
            else:
                x = torch.cat([_rms(e, w["midlayer.input_layernorm.weight"], eps),
                               _rms(hx, w["midlayer.hidden_norm.weight"], eps)], -1)
                r = hx + _attention(x, w, "midlayer.self_attn.", cfg)
                g = r + _mlp(_rms(r, w["midlayer.post_attention_layernorm.weight"], eps),
                             w, "midlayer.mlp.")
                logits = _rms(g, w["norm.weight"], eps) @ w["lm_head.weight"].T
                best = int(logits[-1].argmax())
                tok = best + int(w["d2t"][best])
            drafts.append(tok)
            ids.append(tok)
            hid.append(g[-1])
    return drafts
