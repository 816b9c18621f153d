"""Tiny GGUF files written with ``gguf.GGUFWriter`` from random HF checkpoints, one per
architecture, loaded end to end (metadata -> config -> llama.cpp names -> weights).

Covers what the real SmolLM2 file cannot: qwen2 (q/k/v bias, no q/k permutation), qwen3
(q/k norms, ``attention.key_length`` head_dim), an untied ``output.weight``, and a
quantised (Q8_0) tensor.  For llama the file's q/k rows are permuted exactly as
llama.cpp's ``convert_hf_to_gguf.py`` does, so the loader must undo it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.models.loader import load_model
from tests.models.paged import PagedSession

HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _write_gguf(path: str, arch: str, hf: torch.nn.Module) -> None:
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    if arch == "llama":
        w.add_rope_dimension_count(c.head_dim)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.float().numpy().copy()
        if arch == "llama" and ".q_proj." in name:
            a = _llama_cpp_permute(a, c.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            a = _llama_cpp_permute(a, c.num_key_value_heads)
        if name == "model.embed_tokens.weight":  # one quantised tensor
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(_gguf_name(name), q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            with torch.no_grad():  # the reference must see the same rounding
                t.copy_(torch.from_numpy(gguf.quants.dequantize(
                    q, gguf.GGMLQuantizationType.Q8_0).reshape(a.shape)))
        else:
            w.add_tensor(_gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=128, rms_norm_eps=1e-5, head_dim=16)
MODELS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                   **{"head_dim": 32})),
}


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_synthetic_gguf_roundtrip(arch: str, tmp_path) -> None:
    cfg_cls, model_cls, extra = MODELS[arch]
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(**{**COMMON, **extra})).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # HF zero-inits biases: randomise so they are checked too
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    path = str(tmp_path / f"tiny-{arch}.gguf")
    _write_gguf(path, arch, hf)

    ec = EngineArgs(model=path, device="cpu", dtype="float32",
                    quantization="none").create_engine_config()
    mc = ec.model_config
    assert mc.hf_config.architectures == [model_cls.__name__]
    assert mc.head_dim == hf.config.head_dim
    assert mc.hf_config.tie_word_embeddings == hf.config.tie_word_embeddings
    ours = load_model(mc, torch.device("cpu"), TorchReferenceBackend())
    ids = torch.randint(0, 256, (20,), generator=g).tolist()
    s = PagedSession(ours, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks=8,
                     block_size=8)
    got = torch.cat([s.step({0: ids[:12]})[0]] + [s.step({0: [t]})[0] for t in ids[12:]])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
