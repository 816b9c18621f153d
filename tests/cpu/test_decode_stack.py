"""The CPU decode stack (``models/cpu_decode_stack.py``) against the per-module path it replaces.

The model is a GGUF written by gguf-py (``tests/models/test_gguf_quantised.py``'s tiny
Llama: GQA, q/k/v and gate/up shards of different types, so projections of several
segments and of several parts), kept quantised, on the CPU backend.  The same prompts
run twice on one model, once with the stack and once with it switched off; every decode
step's logits and the KV caches it writes must be bit-identical (the stack runs the same
C kernels in the same order).  Also: what the stack does not take (fp32 weights, a
prompt step) stays on the per-module path, and the C SiLU-and-multiply it shares with
that path agrees with torch's.  Both activation widths of int4 products (int8, GGUF's,
and int16, the other formats') go through the stack.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType as Q

from pagedllm.attention.cpu_backend import CpuBackend
from pagedllm.cpu import silu_mul
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers.quantization import gguf, int4_vnni
from pagedllm.models import cpu_decode_stack as decode_stack
from pagedllm.models.loader import load_model
from tests.models.paged import PagedSession
from tests.models.test_gguf_quantised import TYPES, V, _write

# Every projection packed int4 (Q6_K is not: it has no int4 split), with shards of
# different types, so q/k/v and gate/up are several segments, some of several parts.
STACK_TYPES = {**TYPES, "attn_v": Q.Q4_0}

pytestmark = pytest.mark.skipif(
    decode_stack._lib() is None or not int4_vnni.available(),
    reason="no C compiler or neither AVX512-VNNI nor AVX2: the per-module path runs instead")


def _model(path: str, quantization: str | None = None):
    mc = EngineArgs(model=path, device="cpu", quantization=quantization
                    ).create_engine_config().model_config
    return load_model(mc, torch.device("cpu"), CpuBackend()), mc


def _decode(model, mc, stack: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Three requests (prompts of 5, 9 and 17 tokens) prefilled together, then 12 decode
    steps of all three; the logits of every decode step and the final caches."""
    s = PagedSession(model, mc.num_layers, mc.num_kv_heads, mc.head_dim, num_blocks=16,
                     block_size=8)
    if not stack:
        model.model.cpu_stack = False
    g = torch.Generator().manual_seed(5)
    prompts = {r: torch.randint(3, V, (n,), generator=g).tolist()
               for r, n in enumerate((5, 9, 17))}
    out = s.step(prompts, last_only=True)
    logits = []
    for _ in range(12):
        nxt = {r: [int(out[r][-1].argmax())] for r in prompts}
        out = s.step(nxt)
        logits.append(torch.cat([out[r] for r in prompts]))
    return logits, s.caches


@pytest.mark.parametrize("bits", ["8", "16"])
def test_stack_is_bit_identical_to_the_module_path(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                   bits: str) -> None:
    # GGUF weights take int8 activations (gguf.ACT8); int16 ones are the layout other
    # int4 formats take on the CPU (int_linear), so the stack runs both.
    monkeypatch.setattr(gguf, "ACT8", bits == "8")
    path = str(tmp_path / "mixed.gguf")
    _write(path, STACK_TYPES, Q.Q8_0)
    model, mc = _model(path)
    got, got_caches = _decode(model, mc, stack=True)
    assert isinstance(model.model.cpu_stack, decode_stack.DecodeStack)
    layout = model.model.cpu_stack.layers[0].qkv[0][0].layout
    assert layout == ("vnni4x8" if bits == "8" else "vnni4")
    parts = [len(s) for s in model.model.cpu_stack.layers[0].qkv]
    assert len(parts) > 1 and max(parts) > 1  # several segments, and parts, exercised
    ref, ref_caches = _decode(model, mc, stack=False)
    assert model.model.cpu_stack is False
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    for a, b in zip(got_caches, ref_caches):
        assert torch.equal(a, b)


def test_fp32_weights_keep_the_module_path(tmp_path) -> None:
    path = str(tmp_path / "q.gguf")
    _write(path, {"attn_q": Q.Q4_1}, None)
    model, mc = _model(path, "none")
    _decode(model, mc, stack=True)
    assert model.model.cpu_stack is False  # planned once, refused: no packed int4


def test_silu_mul_matches_torch() -> None:
    x = torch.randn(33, 2 * 200, generator=torch.Generator().manual_seed(0)) * 6
    x[0, :8] = torch.tensor([90.0, -90.0, 0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0])
    x[0, 200:208] = 1.0
    assert silu_mul.applies(x)
    got = silu_mul.silu_mul(x)  # 200 = 12 x 16 + 8: the vector loop and the scalar tail
    ref = F.silu(x[:, :200]) * x[:, 200:]
    big = ref.abs() > 1e-30
    assert ((got - ref).abs()[big] / ref.abs()[big]).max() < 5e-7
    assert (got - ref).abs()[~big].max() < 1e-30
    # A row's result does not depend on the rows around it ...
    assert torch.equal(silu_mul.silu_mul(x[5:6]), got[5:6])
    # ... nor an element's on whether it fell in a 16-wide vector or in the scalar tail.
    y = x.clone()
    y[:, 192:200], y[:, 392:400] = y[:, :8], y[:, 200:208]
    out = silu_mul.silu_mul(y)
    assert torch.equal(out[:, 192:200], out[:, :8])
