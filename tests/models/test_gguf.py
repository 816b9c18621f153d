"""The default SmolLM2-135M-Instruct GGUF: our loader (q/k un-permutation, tied head,
dequantisation), our metadata reader and config builder, and the tokenizer cache, each
against transformers' own GGUF path."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.model_files.gguf_file import GGUFFile
from pagedllm.model_files.resolve import resolve_model
from pagedllm.models.loader import load_model
from tests.models.paged import PagedSession

PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 2, 198, 1, 4093, 198,
     19556, 28, 638, 359, 346, 47, 2],
    [504, 3575, 282, 4649, 314, 7042, 30, 378, 3575, 282],
]


@pytest.fixture(scope="module")
def engine_config():
    return EngineArgs(device="cpu", dtype="float32",
                      quantization="none").create_engine_config()


@pytest.fixture(scope="module")
def hf_model(engine_config, default_model_path, hf_default_model):
    r = engine_config.model_config.resolved  # the file the shared HF model was read from
    assert os.path.samefile(os.path.join(r.directory, r.gguf_file), default_model_path)
    return hf_default_model


@pytest.fixture(scope="module")
def our_model(engine_config):
    return load_model(engine_config.model_config, torch.device("cpu"), TorchReferenceBackend())


def test_logits_match_transformers(engine_config, hf_model, our_model) -> None:
    mc = engine_config.model_config
    s = PagedSession(our_model, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks=16)
    # Both prompts in one step (two requests), then the first one again chunked + decoded.
    got = s.step({0: PROMPTS[0], 1: PROMPTS[1]})
    chunked = [s.step({2: PROMPTS[0][:9]})[2]] + [s.step({2: [t]})[2]
                                                 for t in PROMPTS[0][9:12]]
    for r, ids in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(got[r], ref, atol=2e-4, rtol=0)
        assert torch.equal(got[r].argmax(-1), ref.argmax(-1))
        if r == 0:
            torch.testing.assert_close(torch.cat(chunked), ref[:12], atol=2e-4, rtol=0)


def test_config_matches_transformers(engine_config, hf_model) -> None:
    """Our metadata-built config equals the one transformers derives from the GGUF."""
    ours = engine_config.model_config.hf_config.to_dict()
    theirs = hf_model.config.to_dict()
    ignore = {"_name_or_path", "_model_name_or_path", "architectures", "dtype",
              "transformers_version", "torch_dtype", "quantization_config"}
    diff = {k: (ours.get(k), theirs.get(k)) for k in set(ours) | set(theirs)
            if k not in ignore and ours.get(k) != theirs.get(k)}
    assert not diff
    assert ours["architectures"] == ["LlamaForCausalLM"]
    assert ours["tie_word_embeddings"] is True


def test_reader_matches_gguf_package(engine_config) -> None:
    import gguf

    path = engine_config.model_config.resolved.gguf_path
    ours = GGUFFile(path)
    ref = gguf.GGUFReader(path)
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.shape == tuple(reversed(b.shape.tolist()))
        assert a.ggml_type == int(b.tensor_type) and a.data_offset == b.data_offset
    for i in (0, 1, 5, len(ref.tensors) - 1):
        assert np.array_equal(ours.raw(ours.tensors[i]), np.asarray(ref.tensors[i].data))
    for key in ("llama.block_count", "llama.rope.freq_base", "general.architecture",
                "tokenizer.ggml.eos_token_id"):
        assert ours.metadata[key] == ref.fields[key].contents()
    assert ours.metadata["tokenizer.ggml.tokens"] == ref.fields["tokenizer.ggml.tokens"].contents()


def test_tokenizer_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    resolved = resolve_model(None)
    fresh = resolved.load_tokenizer()
    entries = os.listdir(tmp_path / "tokenizers")
    assert len(entries) == 1 and not entries[0].startswith(".tmp")
    cached = resolved.load_tokenizer()
    text = "Hello there! ünïcode  \n\n spaces\t<|im_end|> 12345"
    assert fresh(text).input_ids == cached(text).input_ids
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert fresh.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        cached.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (fresh.eos_token_id, fresh.bos_token_id, len(fresh)) == \
        (cached.eos_token_id, cached.bos_token_id, len(cached))
