"""Multi-LoRA on the GPU (issue 26): kernel correctness at Llama-3-8B shapes, and what
the adapter delta costs per decoder layer against the base projections.

    python benchmarks/lora_probe.py --out lora_probe.json [--rows 1] [--sweep]
        [--dtype float16]

1. **Correctness** (bf16, or fp16 with ``--dtype float16``; 8 slots of rank 16, rows
   mixing every slot and -1): for each projection (qkv with its 3 shards, o, gate_up
   with 2, down reading ``silu(gate)*up``) and 1 / 4 / 16 / 64 / 256 / 2048 rows, every
   CUDA path of ``lora/layers.py`` (``fused``, ``sgmv``, ``dense``, ``masked``: the
   split-K masked shrink + one addmm, run twice so that its counters must come back
   zeroed, rows without an adapter bit-for-bit) against the fp32 torch
   reference ``lora_ref``; at one row the batch-1 path (``lora_shrink`` + the GEMV
   adding the expand in its epilogue, and for qkv / gate_up the shrink in the RMSNorm's
   launch, whose norm outputs must equal
   ``fused_add_rms_norm``'s bit for bit); ``gemv_qkv_rope`` with an adapter against gemv
   + the reference delta + ``rotary_and_write_kv``; and a ``LlamaMLP`` with LoRA slots
   behind an ``RMSNorm`` linked to its ``gate_up_proj`` on the batch-1 GEMV path against
   the same modules with the GEMV off.  Exits non-zero on a mismatch.
2. **Timing**: a decode-like chain of 32 layers x 4 projections, each on its own weights
   (the base weights rotate through HBM as in a forward), captured in a CUDA graph:
   base only, then base + each LoRA path.  ``(t_lora - t_base) / 32`` is the delta per
   layer; at M = 1 the base is the GEMV (``down`` with the fused SiLU), above it cuBLAS.
   At M = 1 also the engine's batch-1 layer without attention, each kernel reading the
   one before (norm + residual -> ``gemv_qkv_rope`` -> o -> norm -> gate_up -> down),
   base alone vs the path the engine takes with an adapter (``epilogue+norm``: norm +
   shrink, the QKV GEMV with the expand; o's shrink, o's GEMV with the expand; ...):
   **that delta is the W4 figure**.  The W4 target (TPOT <= 1.1x) leaves ~0.4 ms per
   token for 32 layers: ~13 µs a layer.
3. ``--sweep``: launch configurations of ``lora_fused`` at M = 1 per projection.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from pagedllm.kernels.gemv import gemv
from pagedllm.kernels.lora import fused_config, lora_fused, lora_sgmv, lora_shrink
from pagedllm.kernels.lora_masked import lora_masked_, new_counters
from pagedllm.kernels.lora_norm import rms_norm_shrink
from pagedllm.kernels.norm import fused_add_rms_norm
from pagedllm.lora.layers import (
    SGMV_BLOCK_M,
    diag_blocks,
    lora_dense_,
    lora_ref,
    sgmv_tiles,
    slot_owner,
)

DEV = torch.device("cuda")
DT = torch.bfloat16  # the model dtype (--dtype)
L, R, LAYERS = 8, 16, 32
# name: (in features, output shard sizes, input is [gate | up] for silu(gate)*up)
PROJ = {"qkv": (4096, (4096, 1024, 1024), False), "o": (4096, (4096,), False),
        "gate_up": (4096, (14336, 14336), False), "down": (14336, (4096,), True)}
HEADS = (32, 8, 128)  # q heads, KV heads, head_dim: qkv's shards above


def _bounds(sizes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sum(sizes[:i + 1]) for i in range(len(sizes) - 1))


def _slots_weights(k: int, sizes: tuple[int, ...], g: torch.Generator,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked slots as ``LoRALinear`` holds them: A [L, S*R, K], Bt [L, S*R, N]
    block-diagonal over the shards (PEFT-like magnitudes: A ~ 1/sqrt(K), B ~ 0.05)."""
    s, n = len(sizes), sum(sizes)
    dev = g.device
    a = torch.randn(L, s * R, k, generator=g, device=dev) / k ** 0.5
    bt = torch.zeros(L, s * R, n, device=dev)
    off = 0
    for i, size in enumerate(sizes):
        bt[:, i * R:(i + 1) * R, off:off + size] = 0.05 * torch.randn(
            L, R, size, generator=g, device=dev)
        off += size
    return a.to(DEV, DT), bt.to(DEV, DT)


def _silu_mul(gu: torch.Tensor) -> torch.Tensor:
    from pagedllm.kernels.activation import silu_and_mul

    return silu_and_mul(gu)


def _rows_slots(m: int, g: torch.Generator) -> torch.Tensor:
    slots = torch.randint(-1, L, (m,), generator=g, dtype=torch.int32)
    if m == 1:
        slots[0] = 3
    return slots.to(DEV)


def _groups(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The host grouping the manager publishes (``lora/layers.sgmv_tiles``), padded as
    its persistent buffers are."""
    rows, tiles = sgmv_tiles(slots.cpu().numpy(), L)
    t = slots.shape[0]
    rows_buf = torch.zeros(t, dtype=torch.int32)
    rows_buf[:len(rows)] = torch.from_numpy(rows)
    tiles_buf = torch.zeros(1 + 3 * (-(-t // SGMV_BLOCK_M) + L), dtype=torch.int32)
    tiles_buf[:len(tiles)] = torch.from_numpy(tiles)
    return rows_buf.to(DEV), tiles_buf.to(DEV)


def _sgmv(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
          y: torch.Tensor, groups: tuple[torch.Tensor, torch.Tensor] | None = None,
          ) -> torch.Tensor:
    rows, tiles = groups or _groups(slots)
    return lora_sgmv(x, rows, tiles, a, bt, y, SGMV_BLOCK_M)


def _ids() -> torch.Tensor:
    return torch.arange(L, dtype=torch.int32, device=DEV)


def _dense_one_expand(x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor,
                      bt: torch.Tensor, owner: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The dense form before run 19 (A/B only): one expand over all ``L*S*R`` rows of
    the block-diagonal ``Bt`` (multiplying its zero blocks)."""
    n_slots, r, k = a.shape
    shrunk = x @ a.reshape(n_slots * r, k).t()
    shrunk.mul_(slots.to(owner.dtype).unsqueeze(1) == owner.unsqueeze(0))
    return y.addmm_(shrunk, bt.reshape(n_slots * r, -1))


def _check(name: str, got: torch.Tensor, want: torch.Tensor, results: list) -> bool:
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item() + 1e-6
    ok = err <= 2e-2 * scale + 1e-3
    results.append({"check": name, "max_abs_err": err, "ref_max": scale, "ok": ok})
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: max |err| {err:.3g} (ref max {scale:.3g})")
    return ok


def correctness(results: list) -> bool:
    g = torch.Generator().manual_seed(0)
    ok = True
    for name, (k, sizes, silu) in PROJ.items():
        a, bt = _slots_weights(k, sizes, g)
        n = sum(sizes)
        owner = slot_owner(L, a.shape[1], DEV)
        bts, ids = diag_blocks(bt, sizes), _ids()
        for m in (1, 4, 16, 64, 256, 2048):
            x = torch.randn(m, 2 * k if silu else k, generator=g).to(DEV, DT)
            xin = _silu_mul(x) if silu else x
            slots = _rows_slots(m, g)
            # A small base output, so that its rounding to DT after the add is small
            # against the delta compared: got - y against the reference delta.
            y = (0.05 * torch.randn(m, n, generator=g)).to(DEV, DT)
            want = lora_ref(xin.float(), slots, a.float(), bt.float())
            got = lora_fused(x, slots, a, bt, _bounds(sizes), y=y.clone(), silu_mul=silu)
            ok &= _check(f"{name} M={m} fused", got.float() - y.float(), want, results)
            untouched = bool(torch.equal(got[slots < 0], y[slots < 0]))
            ok &= untouched
            if not untouched:
                print(f"  FAIL {name} M={m} fused: a row without an adapter changed")
            got = _sgmv(xin, slots, a, bt, y.clone())
            ok &= _check(f"{name} M={m} sgmv", got.float() - y.float(), want, results)
            got = lora_dense_(xin, slots, a, bts, ids, y.clone())
            ok &= _check(f"{name} M={m} dense", got.float() - y.float(), want, results)
            got = _dense_one_expand(xin, slots, a, bt, owner, y.clone())
            ok &= _check(f"{name} M={m} dense1", got.float() - y.float(), want, results)
            counters = new_counters(DEV)
            for rep in range(2):  # twice: the split-K counters must come back zeroed
                got = lora_masked_(xin, slots, a, bt, counters, y.clone())
                ok &= _check(f"{name} M={m} masked#{rep}", got.float() - y.float(), want,
                             results)
            same = bool(torch.equal(got[slots < 0], y[slots < 0])) and not counters.any()
            ok &= same
            if not same:
                print(f"  FAIL {name} M={m} masked: a row without an adapter changed or "
                      "the counters were left non-zero")
            if m == 1:
                d = lora_fused(x, slots, a, bt, _bounds(sizes), silu_mul=silu)
                ok &= _check(f"{name} M=1 fused fp32 delta", d, want, results)
                ok &= _check_epilogue(name, x, slots, a, bt, g, results)
    ok &= _check_rope(results)
    ok &= _check_mlp(results)
    return ok


def _check_epilogue(name: str, x: torch.Tensor, slots: torch.Tensor, a: torch.Tensor,
                    bt: torch.Tensor, g: torch.Generator, results: list) -> bool:
    """The batch-1 path at one row: ``lora_shrink`` + the GEMV adding the expand (and,
    for qkv / gate_up, the shrink in the norm's launch) against the plain GEMV + the
    fp32 reference delta; slot -1 leaves the GEMV's output bit-for-bit."""
    k, sizes, silu = PROJ[name]
    n = sum(sizes)
    # Small base weights: the output's rounding to DT stays small against the delta.
    w = (0.05 * torch.randn(n, k, generator=g) / k ** 0.5).to(DEV, DT)
    xin = _silu_mul(x) if silu else x
    plain = gemv(x, w, silu_mul=silu)
    want = lora_ref(xin.float(), slots, a.float(), bt.float())
    got = gemv(x, w, silu_mul=silu, lora=lora_shrink(x, slots, a, bt, _bounds(sizes), silu))
    ok = _check(f"{name} M=1 shrink + GEMV epilogue", got.float() - plain.float(), want,
                results)
    none = torch.tensor([-1], dtype=torch.int32, device=DEV)
    same = torch.equal(gemv(x, w, silu_mul=silu,
                            lora=lora_shrink(x, none, a, bt, _bounds(sizes), silu)), plain)
    if not same:
        print(f"  FAIL {name}: the GEMV with slot -1 differs from the plain GEMV")
    ok &= same
    if name in ("qkv", "gate_up"):
        h = torch.randn(1, k, generator=g).to(DEV, DT)
        res = torch.randn(1, k, generator=g).to(DEV, DT)
        nw = (1 + 0.1 * torch.randn(k, generator=g)).to(DEV, DT)
        (y, r), lora = rms_norm_shrink(h, res, nw, 1e-5, slots, a, bt, _bounds(sizes))
        y_ref, r_ref = fused_add_rms_norm(h, res, nw, 1e-5)
        same = torch.equal(y, y_ref) and torch.equal(r, r_ref)
        if not same:
            print(f"  FAIL {name}: the norm + shrink's norm differs from fused_add_rms_norm")
        ok &= same
        got = gemv(y, w, lora=lora).float() - gemv(y, w).float()
        want = lora_ref(y.float(), slots, a.float(), bt.float())
        ok &= _check(f"{name} M=1 norm + shrink, GEMV epilogue", got, want, results)
    return ok


def _check_rope(results: list) -> bool:
    """gemv_qkv_rope with an adapter (split-K shrink, expand in its epilogue) == gemv,
    the reference delta added, then rotary + KV write."""
    from pagedllm.kernels.gemv_rope import gemv_qkv_rope
    from pagedllm.kernels.rotary import rotary_and_write_kv
    from pagedllm.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(1)
    (hq, hkv, d), k = HEADS, PROJ["qkv"][0]
    n = (hq + 2 * hkv) * d
    x = torch.randn(1, k, generator=g).to(DEV, DT)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEV, DT)
    a, bt = _slots_weights(k, (hq * d, hkv * d, hkv * d), g)
    slots = torch.tensor([5], dtype=torch.int32, device=DEV)
    bounds = (hq * d, (hq + hkv) * d)
    delta = lora_ref(x.float(), slots, a.float(), bt.float())
    rope = RotaryEmbedding(d, 4096, {"rope_theta": 500000.0, "rope_type": "default"})
    cs = rope.cos_sin_cache.to(DEV)
    pos = torch.tensor([1234], device=DEV)
    slot_map = torch.tensor([77], dtype=torch.int64, device=DEV)
    cache0 = torch.zeros(2, 8, 16, hkv, d, dtype=DT, device=DEV)
    ref_cache = cache0.clone()
    qkv = (gemv(x, w).float() + delta).to(DT)
    q_ref = qkv[:, :hq * d].clone()
    rotary_and_write_kv(pos, q_ref, qkv[:, hq * d:(hq + hkv) * d], qkv[:, (hq + hkv) * d:],
                        d, cs, ref_cache, slot_map)
    got_cache = cache0.clone()
    out = gemv_qkv_rope(x, w, None, pos, cs, got_cache, slot_map, num_heads=hq,
                        num_kv_heads=hkv, head_dim=d,
                        lora=lora_shrink(x, slots, a, bt, bounds))
    ok = _check("gemv_qkv_rope + delta: q", out[:, :hq * d], q_ref, results)
    return ok & _check("gemv_qkv_rope + delta: KV cache", got_cache, ref_cache, results)


def _check_mlp(results: list) -> bool:
    """An RMSNorm (+ residual) feeding a LlamaMLP with LoRA slots at batch 1, the norm
    linked to ``gate_up_proj`` as the manager links a decoder layer's
    (``lora/manager.link_norms``): the GEMV path (gate_up's shrink in the norm's launch,
    the expands in the GEMVs' epilogues, down's shrink reading silu(gate)*up) against
    the same modules with the GEMV off (norm kernel, cuBLAS + silu_and_mul, the
    one-launch ``lora_fused`` at one row)."""
    import pagedllm.layers.quantization.unquantized as unq
    from pagedllm.layers.norm import RMSNorm
    from pagedllm.lora.layers import LoRALinear, LoRAMapping
    from pagedllm.models.llama import LlamaMLP

    g = torch.Generator().manual_seed(2)
    hidden, inter = PROJ["gate_up"][0], PROJ["gate_up"][1][0]
    torch.set_default_dtype(DT)
    with torch.device(DEV):
        mlp = LlamaMLP(hidden, inter)
        norm = RMSNorm(hidden, 1e-5)
    torch.set_default_dtype(torch.float32)
    for p in mlp.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    norm.weight.data.copy_(1 + 0.1 * torch.randn(hidden, generator=g))
    mapping = LoRAMapping(16, DEV)
    mapping.token_slots[0] = 2
    mapping.active = True
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        lora = LoRALinear(layer, L, R, mapping, DT, DEV, use_triton=True)
        a, bt = _slots_weights(layer.in_per_partition, tuple(layer.output_partition_sizes), g)
        lora.a.copy_(a)
        lora.bt.copy_(bt)
        for blk, want in zip(lora.bts, diag_blocks(bt, tuple(layer.output_partition_sizes))):
            blk.copy_(want)
        layer.lora = lora
    norm.lora_next = mlp.gate_up_proj.lora
    x = torch.randn(1, hidden, generator=g).to(DEV, DT)
    res = torch.randn(1, hidden, generator=g).to(DEV, DT)

    def run() -> torch.Tensor:
        h, _ = norm(x, res)
        return mlp(h)
    unq._GEMV = True
    fused = run()
    unq._GEMV = False
    try:
        plain = run()
    finally:
        unq._GEMV = None
    mapping.active = False
    base = run()
    ok = _check("RMSNorm + LlamaMLP + LoRA, GEMV/epilogues vs cuBLAS", fused, plain,
                results)
    # The adapter really changes the output (the check above is not vacuous).
    moved = (plain.float() - base.float()).abs().max().item()
    results.append({"check": "LoRA delta on the MLP output", "max_abs": moved})
    print(f"  the adapter moves the MLP output by up to {moved:.3g}")
    return ok and moved > 0


def _graph_us(fn, reps: int = 20) -> float:
    """Median µs of one replay of a CUDA graph of ``fn``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) * 1000)
    return statistics.median(times)


def _chain(m: int, path: str | None, base: dict, slots_w: dict, owners: dict,
           g: torch.Generator):
    """A decode-like chain over 32 layers x 4 projections at ``m`` rows: the base matmul
    of each, plus LoRA by ``path`` (None: base only)."""
    slots = torch.arange(m, dtype=torch.int32, device=DEV) % L  # spread evenly
    groups = _groups(slots)
    xs = {name: torch.randn(m, 2 * k if silu else k, generator=g, device=DEV, dtype=DT)
          for name, (k, _, silu) in PROJ.items()}
    outs = {name: torch.empty(m, sum(sizes), dtype=DT, device=DEV)
            for name, (_, sizes, _) in PROJ.items()}
    down_in = _silu_mul(xs["down"])  # the cuBLAS path's input (M > 1)
    ids = _ids()
    bts_w = {name: [diag_blocks(bt, sizes) for _, bt in slots_w[name]]
             for name, (_, sizes, _) in PROJ.items()} if path == "dense" else {}
    counters = new_counters(DEV)

    def run() -> None:
        for i in range(LAYERS):
            for name, (_, sizes, silu) in PROJ.items():
                x, y = xs[name], outs[name]
                xin = down_in if silu else x
                a, bt = slots_w[name][i]
                if path == "epilogue":  # the shrink, then the GEMV with the expand
                    lora = lora_shrink(x, slots, a, bt, _bounds(sizes), silu)
                    gemv(x, base[name][i], out=y, silu_mul=silu, lora=lora)
                    continue
                if m == 1:  # the GEMV, down_proj reading silu(gate)*up itself
                    gemv(x, base[name][i], out=y, silu_mul=silu)
                else:
                    torch.matmul(xin, base[name][i].t(), out=y)
                if path == "fused":
                    lora_fused(x, slots, a, bt, _bounds(sizes), y=y, silu_mul=silu)
                elif path == "sgmv":
                    _sgmv(xin, slots, a, bt, y, groups)
                elif path == "dense":
                    lora_dense_(xin, slots, a, bts_w[name][i], ids, y)
                elif path == "dense1":
                    _dense_one_expand(xin, slots, a, bt, owners[name], y)
                elif path == "masked":
                    lora_masked_(xin, slots, a, bt, counters, y)
    return run


def _layer_chain(lora: bool, base: dict, slots_w: dict, g: torch.Generator):
    """The engine's batch-1 decoder layer without attention, 32 times, each kernel
    reading the one before: norm (+ residual) -> ``gemv_qkv_rope`` (rotary, KV write)
    -> o (on the q columns, standing in for attention's output) -> norm -> gate_up ->
    down (silu(gate)*up).  ``lora``: the path the engine takes with an adapter (qkv's
    and gate_up's shrinks in the norms' launches, o's and down's in a launch of their
    own, every expand in its GEMV's epilogue)."""
    from pagedllm.kernels.gemv_rope import gemv_qkv_rope
    from pagedllm.layers.rotary import RotaryEmbedding

    (hq, hkv, d), hidden = HEADS, PROJ["qkv"][0]
    slots = torch.tensor([3], dtype=torch.int32, device=DEV)
    norms = [(1 + 0.1 * torch.randn(2, hidden, generator=g, device=DEV)).to(DT)
             for _ in range(LAYERS)]
    cs = RotaryEmbedding(d, 4096, {"rope_theta": 500000.0, "rope_type": "default"}
                         ).cos_sin_cache.to(DEV)
    pos = torch.tensor([1234], device=DEV)
    slot_map = torch.tensor([77], dtype=torch.int64, device=DEV)
    cache = torch.zeros(2, 8, 16, hkv, d, dtype=DT, device=DEV)
    h0 = torch.randn(1, hidden, generator=g, device=DEV, dtype=DT)
    r0 = torch.randn(1, hidden, generator=g, device=DEV, dtype=DT)
    b = {name: _bounds(sizes) for name, (_, sizes, _) in PROJ.items()}

    def norm(i: int, j: int, h: torch.Tensor, res: torch.Tensor, name: str):
        if not lora:
            return (*fused_add_rms_norm(h, res, norms[i][j], 1e-5), None)
        a, bt = slots_w[name][i]
        (y, r), ep = rms_norm_shrink(h, res, norms[i][j], 1e-5, slots, a, bt, b[name])
        return y, r, ep

    def shrink(i: int, name: str, x: torch.Tensor, silu: bool = False):
        if not lora:
            return None
        a, bt = slots_w[name][i]
        return lora_shrink(x, slots, a, bt, b[name], silu)

    def run() -> None:
        h, res = h0, r0
        for i in range(LAYERS):
            y, res, ep = norm(i, 0, h, res, "qkv")
            qkv = gemv_qkv_rope(y, base["qkv"][i], None, pos, cs, cache, slot_map,
                                num_heads=hq, num_kv_heads=hkv, head_dim=d, lora=ep)
            attn = qkv[:, :hq * d]
            o = gemv(attn, base["o"][i], lora=shrink(i, "o", attn))
            y, res, ep = norm(i, 1, o, res, "gate_up")
            gu = gemv(y, base["gate_up"][i], lora=ep)
            h = gemv(gu, base["down"][i], silu_mul=True,
                     lora=shrink(i, "down", gu, silu=True))
    return run


def timing(results: list, ms: list[int]) -> None:
    g = torch.Generator(device=DEV).manual_seed(3)
    # 32 layers' weights: the base rotates through HBM (14 GB), the slots too (0.7 GB).
    base = {name: [(torch.randn(sum(sizes), k, generator=g, device=DEV, dtype=DT)
                    .div_(k ** 0.5)) for _ in range(LAYERS)]
            for name, (k, sizes, _) in PROJ.items()}
    slots_w = {name: [_slots_weights(k, sizes, g) for _ in range(LAYERS)]
               for name, (k, sizes, _) in PROJ.items()}
    owners = {name: slot_owner(L, len(sizes) * R, DEV) for name, (_, sizes, _) in PROJ.items()}
    for m in ms:
        t_base = _graph_us(_chain(m, None, base, slots_w, owners, g))
        row = {"M": m, "base_us_per_layer": t_base / LAYERS}
        print(f"M={m}: base {t_base / LAYERS:.1f} µs per layer (4 projections)")
        for path in ("epilogue", "fused", "sgmv", "dense", "dense1", "masked"):
            if path == "fused" and m > 64 or path == "epilogue" and m > 1:
                continue  # fused: recomputes the shrink per output block; epilogue: 1 row
            t = _graph_us(_chain(m, path, base, slots_w, owners, g))
            row[f"{path}_delta_us_per_layer"] = (t - t_base) / LAYERS
            print(f"  + LoRA {path}: +{(t - t_base) / LAYERS:.1f} µs per layer "
                  f"({t / t_base:.3f}x)")
        if m == 1:  # the engine's batch-1 layer (without attention): the W4 figure
            t0 = _graph_us(_layer_chain(False, base, slots_w, g))
            t1 = _graph_us(_layer_chain(True, base, slots_w, g))
            row["layer_base_us"] = t0 / LAYERS
            row["layer_epilogue_norm_delta_us"] = (t1 - t0) / LAYERS
            print(f"M=1 decoder layer (2 norms, QKV+RoPE GEMV, o, gate_up, down): base "
                  f"{t0 / LAYERS:.1f} µs; + LoRA epilogue+norm: "
                  f"+{(t1 - t0) / LAYERS:.1f} µs per layer ({t1 / t0:.3f}x; target "
                  f"<= 13 µs)")
        results.append(row)


def _fused_us(name: str, cfg: tuple[int, int, int], g: torch.Generator) -> float:
    k, sizes, silu = PROJ[name]
    ws = [_slots_weights(k, sizes, g) for _ in range(LAYERS)]
    x = torch.randn(1, 2 * k if silu else k, generator=g, device=DEV, dtype=DT)
    y = torch.zeros(1, sum(sizes), dtype=DT, device=DEV)
    slots = torch.tensor([3], dtype=torch.int32, device=DEV)

    def run() -> None:
        for a, bt in ws:
            lora_fused(x, slots, a, bt, _bounds(sizes), y=y, silu_mul=silu, config=cfg)
    return _graph_us(run, reps=10) / LAYERS


def sweep(results: list) -> None:
    """``lora_fused`` launch configurations at one row, each projection alone (32 layers'
    slots rotating, graph-timed)."""
    g = torch.Generator(device=DEV).manual_seed(4)
    for name, (k, sizes, _) in PROJ.items():
        default = fused_config(sum(sizes), k)
        cfgs = {default} | {(bn, bk, w) for bn in (64, 256)
                            for bk in (512, 1024, 2048) for w in (4, 8)}
        found = sorted((_fused_us(name, cfg, g), cfg) for cfg in cfgs)
        t_default = next(t for t, c in found if c == default)
        print(f"sweep {name}: best {found[0][1]} {found[0][0]:.2f} µs, default {default} "
              f"{t_default:.2f} µs")
        results.append({"sweep": name, "best": found[0][1], "best_us": found[0][0],
                        "default": default, "default_us": t_default})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="lora_probe.json")
    ap.add_argument("--rows", default="1,4,16,64,256,2048", help="M values to time")
    ap.add_argument("--sweep", action="store_true", help="sweep lora_fused's config")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                    help="model dtype of activations and weights")
    args = ap.parse_args()
    global DT
    DT = getattr(torch, args.dtype)
    results: list = []
    print(f"{torch.cuda.get_device_name()}: correctness ({args.dtype} vs the fp32 "
          "reference)")
    ok = correctness(results)
    timing(results, [int(m) for m in args.rows.split(",")])
    if args.sweep:
        sweep(results)
    with open(args.out, "w") as f:
        json.dump({"ok": ok, "dtype": args.dtype, "results": results}, f, indent=1)
    print("correctness:", "ok" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
