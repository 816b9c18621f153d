"""Tensor-parallel ranks read only their shard of each checkpoint tensor
(``models/lazy_weight.py``): per rank, about half of every sharded tensor is read, and
the weights equal what the layers take from the whole tensor.  Tiny random Llama
checkpoints, as safetensors (transformers) and as a Q8_0 GGUF (gguf-py) whose q/k rows
are permuted as llama.cpp stores them; a GGUF column range that cuts a quantisation
block falls back to a whole read and says why.  Ranks are built in process (loading
needs no collectives); end-to-end TP=2 greedy parity is tests/e2e/test_parallel.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import transformers

from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.distributed.parallel_state import (
    GroupCoordinator,
    ParallelState,
    parallel_context,
)
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.models.lazy_weight import ReadCounter
from pagedllm.models.loader import iter_gguf, iter_safetensors, load_model
from pagedllm.models.registry import get_model_class
from tests.models.test_gguf_synthetic import _gguf_name, _llama_cpp_permute

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=128, rms_norm_eps=1e-5, head_dim=16,
              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


def _rank(r: int) -> ParallelState:
    return ParallelState(rank=r, world_size=2, tp=GroupCoordinator(ranks=(0, 1),
                                                                   rank_in_group=r))


def _hf() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return hf


def _write_q8_gguf(path: str, hf: torch.nn.Module) -> None:
    import gguf

    c = hf.config
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    for name, t in hf.state_dict().items():
        a = t.float().numpy().copy()
        if ".q_proj." in name:
            a = _llama_cpp_permute(a, c.num_attention_heads)
        elif ".k_proj." in name:
            a = _llama_cpp_permute(a, c.num_key_value_heads)
        if a.ndim == 2:  # every matrix Q8_0 (32-element blocks)
            a = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(_gguf_name(name), a, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(_gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _load_both(path: str, r: int, whole: Iterator) -> tuple[dict, dict, ReadCounter]:
    """Rank ``r``'s state dict loaded shard-only and from whole tensors, and what the
    shard-only load read."""
    mc = EngineArgs(model=path, device="cpu", dtype="float32",
                    quantization="none").create_engine_config().model_config
    counter = ReadCounter()
    with parallel_context(_rank(r)), torch.device("cpu"):
        lazy = load_model(mc, torch.device("cpu"), TorchReferenceBackend(), counter)
        plain = get_model_class(mc.hf_config)(mc.hf_config, TorchReferenceBackend())
        plain.load_weights(whole(mc))
    return lazy.state_dict(), plain.state_dict(), counter


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_tp2_ranks_read_half_of_each_sharded_tensor(fmt: str, tmp_path) -> None:
    hf = _hf()
    if fmt == "safetensors":
        hf.save_pretrained(tmp_path, safe_serialization=True)
        path = str(tmp_path)
        def whole(mc):  # noqa: E306
            return iter_safetensors(path)
    else:
        path = str(tmp_path / "tiny.gguf")
        _write_q8_gguf(path, hf)
        def whole(mc):  # noqa: E306
            return iter_gguf(path, mc.hf_config)
    reads = []
    for r in range(2):
        lazy, plain, counter = _load_both(path, r, whole)
        assert lazy.keys() == plain.keys()
        for k in lazy:  # the same weights as the layers take from the whole tensors
            torch.testing.assert_close(lazy[k], plain[k], rtol=0, atol=0, msg=k)
        reads.append(counter)
    sharded = [n for n in reads[0].whole if n.endswith("proj.weight") or "embed" in n
               or n == "lm_head.weight"]
    assert len(sharded) == 2 * 7 + 2
    for n in sharded:
        fractions = [c.read[n] / c.whole[n] for c in reads]
        if fmt == "gguf" and "down_proj" in n:
            # 96 input features split 48 / 48: the split cuts a 32-element Q8_0 block.
            assert fractions == [1.0, 1.0]
            assert "cut a 32-element quantisation block" in reads[0].fallbacks[n]
        else:
            assert fractions == [0.5, 0.5], n
    assert (fmt == "gguf") == bool(reads[1].fallbacks)
    total_read = sum(sum(c.read.values()) for c in reads)
    assert total_read < 1.3 * sum(reads[0].whole.values())
    assert "read" in reads[0].summary()
