"""A GGUF file run with its tensors kept quantised (quantization "gguf", the default for
a quantised GGUF) against the same file dequantised to float32 (quantization "none").

The file is written by gguf-py: a tiny Llama whose fused q/k/v and gate/up shards have
different types (Q4_1, Q8_0, Q6_K, Q4_K, Q5_K, Q4_0), a Q8_0 tied embedding; gguf-py's
own quantiser for the types it writes, random block bytes for the K-quants.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers.quantization import QUANTIZATION_METHODS
from pagedllm.models.loader import load_model, weight_bytes
from tests.layers.test_gguf_quant import _raw
from tests.models.paged import PagedSession

H, FF, V, LAYERS, HEADS, KV = 256, 512, 512, 2, 4, 2
TYPES = {"attn_q": Q.Q4_1, "attn_k": Q.Q8_0, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K,
         "ffn_gate": Q.Q5_K, "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_1}


def _write(path: str, types: dict[str, Q], embd: Q | None) -> None:
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FF)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(H // HEADS)
    w.add_token_list([f"t{i}" for i in range(V)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    rng = np.random.default_rng(0)
    shapes = {"attn_q": (H, H), "attn_k": (H // HEADS * KV, H), "attn_v": (H // HEADS * KV, H),
              "attn_output": (H, H), "ffn_gate": (FF, H), "ffn_up": (FF, H),
              "ffn_down": (H, FF)}

    def add(name: str, shape: tuple[int, int], qtype: Q | None, seed: int) -> None:
        if qtype is None:
            w.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))
        else:
            w.add_tensor(name, _raw(qtype, *shape, seed=seed), raw_dtype=qtype)

    add("token_embd.weight", (V, H), embd, 1)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    for i in range(LAYERS):
        for j, (part, shape) in enumerate(shapes.items()):
            add(f"blk.{i}.{part}.weight", shape, types.get(part), 10 * i + j)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(H, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(H, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _run(path: str, quantization: str | None) -> tuple[torch.Tensor, torch.nn.Module, str]:
    mc = EngineArgs(model=path, device="cpu", quantization=quantization
                    ).create_engine_config().model_config
    model = load_model(mc, torch.device("cpu"), TorchReferenceBackend())
    ids = torch.randint(0, V, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    s = PagedSession(model, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks=8,
                     block_size=8)
    logits = torch.cat([s.step({0: ids[:8]})[0]] + [s.step({0: [t]})[0] for t in ids[8:]])
    return logits, model, str(mc.quantization)


def test_mixed_types_match_the_dequantised_model(tmp_path) -> None:
    path = str(tmp_path / "mixed.gguf")
    _write(path, TYPES, Q.Q8_0)
    ref, dense, name = _run(path, "none")
    assert name == "None"
    got, quant, name = _run(path, None)
    assert name == "gguf"
    # The embedding's rows are the dequantised table, bitwise.
    ids = torch.tensor([0, 7, 64, 511])
    assert torch.equal(quant.model.embed_tokens(ids), dense.model.embed_tokens(ids))
    # Linear layers compute from bf16 activations: logits agree to bf16 accuracy.
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < 3e-2, err
    assert weight_bytes(quant) < weight_bytes(dense) / 2


def test_detection_and_overrides(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = str(tmp_path / "f32.gguf")
    _write(plain, {}, None)
    assert EngineArgs(model=plain, device="cpu").create_engine_config(
    ).model_config.quantization is None
    quant = str(tmp_path / "q.gguf")
    _write(quant, {"attn_q": Q.Q4_0}, None)
    assert EngineArgs(model=quant, device="cpu").create_engine_config(
    ).model_config.quantization == "gguf"
    monkeypatch.setitem(QUANTIZATION_METHODS, "fp8", "x:y")
    # fp8 quantises the dequantised weights at load; a checkpoint format is refused.
    assert EngineArgs(model=quant, device="cpu", quantization="fp8"
                      ).create_engine_config().model_config.quantization == "fp8"
    with pytest.raises(ValueError,
                       match="quantization='compressed-tensors' but the checkpoint is a GGUF"):
        EngineArgs(model=quant, device="cpu",
                   quantization="compressed-tensors").create_engine_config()


def test_truncated_quantised_tensor_is_a_load_error(tmp_path) -> None:
    path = str(tmp_path / "t.gguf")
    _write(path, {"attn_q": Q.Q4_1}, None)
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) - 1000)
    with pytest.raises(ValueError, match="truncated GGUF file"):
        EngineArgs(model=path, device="cpu").create_engine_config()
