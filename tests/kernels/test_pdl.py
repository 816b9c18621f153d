"""Programmatic dependent launch (``kernels/pdl.py``).

On the CPU (and in the interpreter) PDL must be off.  On a Hopper GPU a batch-1 layer's
kernel chain -- fused add+RMSNorm, QKV GEMV, rotary + KV write, paged attention (split
KV: attention + merge), o_proj GEMV, add+RMSNorm, gate_up GEMV, SiLU-mul + down GEMV --
runs 8 times over with PDL on, eagerly and replayed from a CUDA graph, and must equal the
same chain with PDL off bit for bit.  Each kernel reads what the previous one wrote and
the buffers are reused from layer to layer, so a kernel that read its input before its
predecessor finished (or wrote over something still being read) would show.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import pdl as pdl_mod
from pagedllm.kernels.pdl import pdl_enabled, pdl_launch_args


def test_pdl_is_off_without_a_hopper_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pdl_launch_args(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl_enabled(torch.device("cuda", 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(pdl_mod, "_capability_ok", lambda index: False)  # before Hopper
    assert not pdl_enabled(torch.device("cuda", 0))


def _layer_chain(state: dict[str, torch.Tensor], layers: int) -> torch.Tensor:
    from pagedllm.kernels.gemv import gemv
    from pagedllm.kernels.norm import fused_add_rms_norm
    from pagedllm.kernels.paged_attention import paged_attention
    from pagedllm.kernels.rotary import rotary_and_write_kv

    s = state
    hidden, residual = s["hidden"].clone(), s["residual"].clone()
    qkv, attn, o = s["qkv"], s["attn"], s["o"]
    gate_up, down = s["gate_up"], s["down"]
    hq, hk, d = 32, 8, 128
    for _ in range(layers):
        hidden, residual = fused_add_rms_norm(hidden, residual, s["norm_w"], 1e-5,
                                              inplace=True)
        gemv(hidden, s["w_qkv"], out=qkv)
        q = qkv[:, :hq * d].view(1, hq, d)
        k = qkv[:, hq * d:(hq + hk) * d].view(1, hk, d)
        v = qkv[:, (hq + hk) * d:].view(1, hk, d)
        rotary_and_write_kv(s["pos"], q, k, v, d, s["cos_sin"], s["kv"], s["slot"])
        paged_attention(q, s["kv"], s["bt"], s["seq_lens"], s["qsl"], num_reqs=1,
                        max_query_len=1, max_seq_len=1000,
                        scale=d ** -0.5, out=attn, num_splits=4)
        gemv(attn.view(1, -1), s["w_o"], out=o)
        hidden, residual = fused_add_rms_norm(o, residual, s["norm_w"], 1e-5, inplace=True)
        gemv(hidden, s["w_gate_up"], out=gate_up)
        gemv(gate_up, s["w_down"], out=down, silu_mul=True)
        hidden = down.clone()
    return torch.cat([hidden, residual], dim=1)


@pytest.mark.gpu
def test_pdl_chain_equals_serial_eager_and_graphed(monkeypatch: pytest.MonkeyPatch) -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs a CUDA device of compute capability >= 9.0")
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    hid, inter, hq, hk, d, bs, ctx = 4096, 14336, 32, 8, 128, 16, 1000

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dt)

    num_blocks = ctx // bs + 2
    state = {
        "hidden": rnd(1, hid), "residual": rnd(1, hid), "norm_w": rnd(hid),
        "w_qkv": rnd((hq + 2 * hk) * d, hid, scale=hid ** -0.5),
        "w_o": rnd(hid, hq * d, scale=(hq * d) ** -0.5),
        "w_gate_up": rnd(2 * inter, hid, scale=hid ** -0.5),
        "w_down": rnd(hid, inter, scale=inter ** -0.5),
        "qkv": torch.empty(1, (hq + 2 * hk) * d, dtype=dt, device=dev),
        "attn": torch.empty(1, hq, d, dtype=dt, device=dev),
        "o": torch.empty(1, hid, dtype=dt, device=dev),
        "gate_up": torch.empty(1, 2 * inter, dtype=dt, device=dev),
        "down": torch.empty(1, hid, dtype=dt, device=dev),
        "pos": torch.tensor([ctx - 1], device=dev),
        "cos_sin": torch.randn(ctx, d, generator=g, device=dev),
        "kv": rnd(2, num_blocks, bs, hk, d),
        "slot": torch.tensor([ctx - 1], device=dev),
        "bt": torch.arange(num_blocks, dtype=torch.int32, device=dev)[None],
        "seq_lens": torch.tensor([ctx], dtype=torch.int32, device=dev),
        "qsl": torch.tensor([0, 1], dtype=torch.int32, device=dev),
    }
    kv0 = state["kv"].clone()

    def run(pdl: str, graphed: bool) -> torch.Tensor:
        monkeypatch.setattr(pdl_mod, "_capability_ok", lambda index: pdl == "1")
        state["kv"].copy_(kv0)
        if not graphed:
            out = _layer_chain(state, 8)
            torch.cuda.synchronize()
            return out
        _layer_chain(state, 8)  # compile outside capture
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            out = _layer_chain(state, 8)
        torch.cuda.current_stream().wait_stream(stream)
        state["kv"].copy_(kv0)
        for _ in range(3):  # replays start from the same cache, so they must agree
            state["kv"].copy_(kv0)
            graph.replay()
        torch.cuda.synchronize()
        return out.clone()

    ref = run("0", graphed=False)
    assert torch.isfinite(ref.float()).all()
    assert torch.equal(run("1", graphed=False), ref)
    assert torch.equal(run("1", graphed=True), ref)
