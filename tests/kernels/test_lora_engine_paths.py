"""The CUDA LoRA paths of a whole engine, run on the CPU under the Triton interpreter:
both slot maps of the manager, the one-launch fused kernel (steps of up to 4 rows, incl.
the pruned last layer's per-request rows) and the masked split-K kernels (larger steps),
in a batch mixing 3 PEFT adapters and the base model;
and, with the batch-1 GEMV forced on for one-row inputs (on CUDA: bf16/fp16 only), the
split-K shrink plus the GEMV adding the expand in its epilogue (``LoRALinear.gemv``:
qkv's 3 shards, o, gate_up, and down reading ``silu(gate) * up``), the shrinks of qkv
and gate_up in the launch of the RMSNorm before them (``kernels/lora_norm.py``).  Greedy tokens must
equal transformers + PEFT in fp32.  (The QKV + RoPE GEMV needs the Triton attention
backend: ``tests/kernels/test_gemv_rope.py`` and ``tests/lora``'s gpu-marked test
cover it with an adapter.)
"""

from __future__ import annotations

import os

import pytest
import torch
from kernel_refs import ON_GPU

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.worker.lora import layers as lora_layers
from pagedllm.worker.lora.layers import FUSED_MAX_ROWS
from tests.lora.fixtures import hf_greedy, make_adapters, tiny_llama

N_TOKENS = 4


@pytest.mark.skipif(ON_GPU, reason="on a GPU tests/lora runs these paths natively")
@pytest.mark.parametrize("gemv", [False, True])
def test_triton_lora_paths_match_peft(tmp_path, monkeypatch, gemv: bool) -> None:
    root = str(tmp_path)
    base = tiny_llama(os.path.join(root, "base"))
    adapters = make_adapters(base, root, merge=False)
    llm = LLM(os.path.join(root, "base"), skip_tokenizer_init=True, device="cpu",
              dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8,
              kv_cache_memory_bytes=4 << 20, block_size=4, max_num_seqs=16,
              max_num_batched_tokens=48)
    mgr = llm.llm_engine.client.core.executor.worker.runner.lora
    # What the manager does on CUDA for steps above the fused rows up to
    # MASKED_MAX_ROWS (here every step): the split-K masked shrink + one addmm.
    monkeypatch.setattr(lora_layers, "MASKED_MAX_ROWS", 1 << 30)
    paths: list[str] = []
    real_path = lora_layers.lora_path

    def counted_path(rows: int, use_triton: bool) -> str:
        paths.append(real_path(rows, use_triton))
        return paths[-1]
    monkeypatch.setattr(lora_layers, "lora_path", counted_path)
    for layer in mgr.layers.values():
        layer.use_triton = True
    assert FUSED_MAX_ROWS == 4  # the split the step sizes below exercise
    gemv_calls: list[bool] = []
    norm_calls: list[bool] = []
    pending_hits: list[bool] = []
    if gemv:  # what gemv_shape decides on CUDA in bf16, for every one-row input
        from pagedllm.layers import linear

        monkeypatch.setattr(linear, "gemv_shape", lambda x, w: x.dim() == 2
                            and x.shape[0] == 1 and x.is_contiguous())
        real = lora_layers.LoRALinear.gemv

        def counted(self, *args, **kwargs):
            gemv_calls.append(self.mapping.active)
            return real(self, *args, **kwargs)
        monkeypatch.setattr(lora_layers.LoRALinear, "gemv", counted)
        real_norm = lora_layers.LoRALinear.norm

        def counted_norm(self, *args, **kwargs):
            out = real_norm(self, *args, **kwargs)
            norm_calls.append(out is not None)
            return out
        monkeypatch.setattr(lora_layers.LoRALinear, "norm", counted_norm)
        real_shrink = lora_layers.LoRALinear.gemv_lora

        def counted_shrink(self, x, *args, **kwargs):
            pending_hits.append(self._pending is not None and self._pending[0] is x)
            return real_shrink(self, x, *args, **kwargs)
        monkeypatch.setattr(lora_layers.LoRALinear, "gemv_lora", counted_shrink)
    prompts = [torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(n))
               .tolist() for n in (5, 23)]
    models = [a.peft_model for a in adapters] + [base]
    loras = [LoRARequest(a.name, i + 1, a.path) for i, a in enumerate(adapters)] + [None]
    sp = SamplingParams(temperature=0.0, max_tokens=N_TOKENS, ignore_eos=True)

    def run(batch: list[tuple[list[int], LoRARequest | None]],
            params: SamplingParams = sp) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in batch], params,
                            use_tqdm=False, lora_request=[lr for _, lr in batch])
        return [list(o.outputs[0].token_ids) for o in outs]

    want = {(i, j): hf_greedy(m, p, N_TOKENS) for i, p in enumerate(prompts)
            for j, m in enumerate(models)}
    # 8 requests: prefill chunks of up to 48 rows (masked) whose last layer runs on
    # one row per request, then 8-row decode steps (masked).
    pairs = [(i, j) for i in range(len(prompts)) for j in range(len(models))]
    assert run([(prompts[i], loras[j]) for i, j in pairs]) == [want[p] for p in pairs]
    assert "masked" in paths and "fused" in paths  # both forms ran with adapters active
    # One request at a time with an adapter: prefill (masked, pruned to 1 row: fused,
    # or the GEMV with the LoRA epilogue) and a 1-row decode (the same; one decode step
    # is enough -- later ones repeat its launches, ~1.4 s each under the interpreter).
    one = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for j in range(len(models)) if gemv else [0]:
        assert run([(prompts[1], loras[j])], one) == [want[(1, j)][:2]], models[j]
    if gemv:  # 1-row steps ran LoRALinear.gemv and the norm + shrink, adapters active
        assert any(gemv_calls) and any(norm_calls)
        # and every shrink a norm ran was the one its projection used
        assert sum(pending_hits) == sum(norm_calls) > 0
