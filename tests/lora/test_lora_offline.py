"""Multi-LoRA through the offline ``LLM``: greedy tokens equal transformers + PEFT (and
the merged model) in fp32; a batch mixing adapters equals each alone; the prefix cache
keeps adapters apart; bad adapters are a ValueError naming them."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.lora.fixtures import hf_greedy, make_adapters, tiny_llama

N_TOKENS = 6
PROMPTS = [
    torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    for n in (7, 19, 40)
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora"))
    base = tiny_llama(os.path.join(root, "base"))
    adapters = make_adapters(base, root)
    # max_loras=2 < 3 adapters: a mixed batch needs the scheduler's per-step limit and
    # slot eviction; max_cpu_loras=2: the host cache evicts too.
    llm = LLM(os.path.join(root, "base"), skip_tokenizer_init=True, device="cpu",
              dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              max_cpu_loras=2, kv_cache_memory_bytes=4 << 20, block_size=4,
              max_num_seqs=16, max_num_batched_tokens=64)
    reqs = [LoRARequest(a.name, i + 1, a.path) for i, a in enumerate(adapters)]
    want = {a.name: [hf_greedy(a.peft_model, p, N_TOKENS) for p in PROMPTS]
            for a in adapters}
    want["base"] = [hf_greedy(base, p, N_TOKENS) for p in PROMPTS]
    return llm, adapters, reqs, want, root


def _greedy(llm, prompts, lora_request) -> list[list[int]]:
    sp = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                        lora_request=lora_request)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_each_adapter_matches_peft_and_merged(setup) -> None:
    llm, adapters, reqs, want, _ = setup
    for a, req in zip(adapters, reqs):
        got = _greedy(llm, PROMPTS, req)
        assert got == want[a.name], a.name
        merged = [hf_greedy(a.merged, p, N_TOKENS) for p in PROMPTS[:1]]
        assert got[:1] == merged, a.name
        # The adapter really changes the output (B is not zero).
        assert got != want["base"], a.name
    assert _greedy(llm, PROMPTS, None) == want["base"]


def test_mixed_batch_equals_each_alone(setup) -> None:
    llm, adapters, reqs, want, _ = setup
    names = [a.name for a in adapters] + ["base"]
    loras = [*reqs, None]
    prompts = [p for p in PROMPTS for _ in loras]
    got = _greedy(llm, prompts, [lr for _ in PROMPTS for lr in loras])
    expect = [want[n][i] for i in range(len(PROMPTS)) for n in names]
    assert got == expect


def test_prefix_cache_keeps_adapters_apart(setup) -> None:
    """The base model fills the cache with a long prompt's blocks; the same prompt under
    an adapter must not reuse them (its K/V differ), nor may the adapter's blocks serve
    another adapter."""
    llm, adapters, reqs, want, _ = setup
    llm.reset_prefix_cache()
    long = PROMPTS[2]
    assert _greedy(llm, [long], None) == [want["base"][2]]
    assert _greedy(llm, [long], reqs[0]) == [want[adapters[0].name][2]]
    assert _greedy(llm, [long], reqs[2]) == [want[adapters[2].name][2]]
    assert _greedy(llm, [long], reqs[0]) == [want[adapters[0].name][2]]


def test_bad_adapters_are_value_errors(setup, tmp_path) -> None:
    llm, adapters, _, _, root = setup
    sp = SamplingParams(max_tokens=2)
    # Rank above max_lora_rank (8).
    big = str(tmp_path / "big")
    shutil.copytree(adapters[0].path, big)
    cfg = json.load(open(os.path.join(big, "adapter_config.json")))
    json.dump({**cfg, "r": 16}, open(os.path.join(big, "adapter_config.json"), "w"))
    with pytest.raises(ValueError, match="'big'.*rank 16 exceeds max_lora_rank 8"):
        llm.generate({"prompt_token_ids": [1, 2]}, sp,
                     lora_request=LoRARequest("big", 10, big))
    # A truncated safetensors file.
    bad = str(tmp_path / "bad")
    shutil.copytree(adapters[1].path, bad)
    f = os.path.join(bad, "adapter_model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[:len(data) // 2])
    with pytest.raises(ValueError, match="'bad'.*corrupt"):
        llm.generate({"prompt_token_ids": [1, 2]}, sp,
                     lora_request=LoRARequest("bad", 11, bad))
    with pytest.raises(ValueError, match="'nowhere'.*adapter_config.json"):
        llm.generate({"prompt_token_ids": [1, 2]}, sp,
                     lora_request=LoRARequest("nowhere", 12, str(tmp_path / "none")))
    with pytest.raises(ValueError, match="lora_request: got 2 for 1"):
        llm.generate({"prompt_token_ids": [1, 2]}, sp, lora_request=[None, None])
    # The engine still serves.
    assert len(llm.generate({"prompt_token_ids": [1, 2]}, sp, use_tqdm=False)) == 1


def test_lora_args_are_validated(tmp_path) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(enable_lora=True, max_loras=4, max_cpu_loras=2)._lora_config()
    with pytest.raises(ValueError, match="max_lora_rank"):
        EngineArgs(enable_lora=True, max_lora_rank=0)._lora_config()
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/p")


@pytest.mark.gpu
def test_cuda_graphs_and_triton_kernels_match_peft(setup) -> None:
    """On CUDA (fp32, CUDA graphs on): decode steps replay graphs holding the Triton
    shrink/expand kernels; a mixed batch still gives PEFT's tokens."""
    _, adapters, reqs, want, root = setup
    llm = LLM(os.path.join(root, "base"), skip_tokenizer_init=True, device="cuda",
              dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
              kv_cache_memory_bytes=64 << 20, block_size=16, max_num_seqs=16)
    names = [a.name for a in adapters] + ["base"]
    loras = [*reqs, None]
    prompts = [p for p in PROMPTS for _ in loras]
    got = _greedy(llm, prompts, [lr for _ in PROMPTS for lr in loras])
    assert got == [want[n][i] for i in range(len(PROMPTS)) for n in names]


@pytest.mark.gpu
def test_batch1_fused_paths_with_adapters(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 at batch 1 on CUDA (eager, so the GEMV switch below applies): the GEMV fast
    paths with adapters -- every GEMV adding the expand in its epilogue (the QKV GEMV
    before RoPE and the KV write), the shrinks of qkv / gate_up in the RMSNorm's launch,
    ``down_proj``'s GEMV and shrink both reading ``silu(gate) * up`` -- against the same
    engine with the GEMV off (cuBLAS, the delta added after each projection): the same
    greedy tokens while they agree, log-probs within bf16 noise, and each adapter really
    moves them."""
    import pagedllm.layers.linear as linear
    import pagedllm.layers.quantization.unquantized as unq

    gemv_shape = unq.gemv_shape

    _, _, reqs, _, root = setup
    llm = LLM(os.path.join(root, "base"), skip_tokenizer_init=True, device="cuda",
              dtype="bfloat16", enable_lora=True, max_loras=2, max_lora_rank=8,
              enforce_eager=True, kv_cache_memory_bytes=64 << 20, block_size=16,
              max_num_seqs=1)
    sp = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True, logprobs=3)

    def run(lora, gemv: bool):
        shape = gemv_shape if gemv else (lambda x, w: False)  # off: cuBLAS everywhere
        monkeypatch.setattr(unq, "gemv_shape", shape)
        monkeypatch.setattr(linear, "gemv_shape", shape)
        out = llm.generate([{"prompt_token_ids": PROMPTS[1]}], sp, use_tqdm=False,
                           lora_request=lora)[0].outputs[0]
        return list(out.token_ids), out.logprobs

    _, base_lp = run(None, True)
    for req in reqs:
        (tok, lp), (tok_ref, lp_ref) = run(req, True), run(req, False)
        assert tok[0] == tok_ref[0], req.lora_name
        for i in range(N_TOKENS):  # steps 1.. are batch-1 decodes: the GEMV paths
            for t, want in lp_ref[i].items():
                if t in lp[i]:
                    assert abs(lp[i][t].logprob - want.logprob) < 0.1, (req, i, t)
            if tok[i] != tok_ref[i]:
                break  # a near tie flipped: later steps see different inputs
        # The first token's distribution (same inputs as the base run) moved.
        assert lp[0].keys() != base_lp[0].keys() or any(
            abs(lp[0][t].logprob - base_lp[0][t].logprob) > 0.05 for t in lp[0]), \
            f"{req.lora_name} changed nothing"
