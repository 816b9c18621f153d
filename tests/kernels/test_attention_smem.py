"""The attention plans compile for an H100/H200 (sm_90): they fit its shared memory,
spill no registers, and stage their KV loads through shared memory (cp.async).

No GPU needed: a subprocess without ``TRITON_INTERPRET`` compiles the kernels for an
sm_90 target with each launch plan ``plan_attention`` picks, with the argument
divisibility Triton's runtime specialises on (so it is the kernel the GPU runs), and
runs Triton's bundled ``ptxas -v`` on the PTX.  A plan that asks for more shared memory
than a block may have (227 KB) would fail at its first launch with ``OutOfResources``;
one that spills registers or loads its KV tiles through registers runs, only slower.
This catches all three in CI.  (Compiled without the divisibility hints, the Llama-3-8B
decode plan spills 2.2 KB per thread and has no cp.async copies: not the real kernel.)
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.kernels.sm90_compile import run_script

pytest.importorskip("triton")

SM90_MAX_SHARED = 227 * 1024  # bytes of dynamic shared memory per block on sm_90

# (name, head_dim, num_heads, num_kv_heads, num_reqs, max_query_len, q_filter)
CASES = [
    ("llama decode, unsplit", 128, 32, 8, 256, 1, 0),
    ("llama decode, split", 128, 32, 8, 1, 1, 0),
    ("smollm decode, unsplit", 64, 9, 3, 256, 1, 0),
    ("head_dim 256 decode, unsplit", 256, 16, 8, 256, 1, 0),
]

# Shared by both scripts: compile one kernel for sm_90 and report its resources.
_BUILD = r"""
    import json, re, sys
    import triton
    from tests.kernels.sm90_compile import compile_sm90

    # The strides a launch passes are multiples of head_dim (>= 64) and the tensors are
    # 16-byte aligned, so Triton's runtime specialises them as divisible by 16; without
    # that hint the compiler cannot vectorise the KV loads into cp.async copies and
    # builds a different (spilling) kernel from the one that runs on the GPU.
    DIVISIBLE = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb",
                 "stride_cs", "stride_ch")

    def build(kernel, sig, consts, num_heads, options):
        div = [i for i, n in enumerate(sig) if sig[n].startswith("*") or n in DIVISIBLE
               or (n == "num_heads" and num_heads % 16 == 0)]
        k, st = compile_sm90(kernel, sig, consts, options, div)
        # Pipeline buffers: shared allocations of <stages>x<rows>x<cols>; the deepest
        # (K or V) is how many KV tiles a program keeps in flight.
        bufs = re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x\d+x\d+x",
                          k.asm["ttgir"])
        return {**st, "async_copies": k.asm["ttgir"].count("async_copy_global_to_local"),
                "kv_buffers": max((int(b) for b in bufs), default=0)}
"""

_SCRIPT = textwrap.dedent(_BUILD + """
    from pagedllm.kernels.paged_attention import _paged_attn_kernel, plan_attention

    out = []
    for name, d, h, kvh, reqs, mql, q_filter in json.loads(sys.argv[1]):
        forced = 1 if q_filter else None  # a mixed batch's two launches never split
        p = plan_attention(num_reqs=reqs, max_query_len=mql, num_heads=h,
                           num_kv_heads=kvh, block_size=16, sm_count=132,
                           num_splits=forced, head_dim=d)
        split = p.num_splits > 1
        acc = "*fp32" if split else "*bf16"
        sig = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
               "out_ptr": acc, "m_ptr": "*fp32" if split else "*bf16",
               "l_ptr": "*fp32" if split else "*bf16", "block_tables_ptr": "*i32",
               "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "limits_ptr": "*i32",
               "scale_log2": "fp32"}
        for k in ("num_reqs", "num_heads", "num_splits", "stride_qt", "stride_qh",
                  "stride_ot", "stride_oh", "stride_cb", "stride_cs", "stride_ch",
                  "stride_bt"):
            sig[k] = "i32"
        sig["v_scale"] = "fp32"
        consts = dict(GQA=h // kvh, HEAD_DIM=d, DIM_P2=triton.next_power_of_2(d),
                      BLOCK_SIZE=16, KV_FP8=False, BLOCK_M=p.block_m, BLOCK_Q=p.block_q,
                      TILE_N=p.tile_n, SPLIT=split, F32_DOT=False, WHILE_LOOP=False,
                      Q_FILTER=q_filter, DECODE=mql == 1 and q_filter == 0, USE_PDL=True,
                      WINDOW=0, SOFTCAP=0.0)
        st = build(_paged_attn_kernel, sig, consts, h,
                   {"num_warps": p.num_warps, "num_stages": p.num_stages})
        out.append({"name": name, "plan": repr(p), **st})
    print(json.dumps(out))
""")


def _compile(script: str, cases: list, tmp_path) -> list[dict]:
    """Run ``script`` (which prints a JSON list, one entry per case) in a subprocess
    without the interpreter, with an empty Triton cache (a real compile, not a hit)."""
    results = run_script(script, tmp_path, json.dumps(cases))
    assert len(results) == len(cases)
    return results


def _check(r: dict, max_shared: int) -> None:
    assert 0 < r["shared"] <= max_shared, r
    assert r["spill_stores"] == 0, r
    assert r["async_copies"] > 0, r  # K/V tiles pipelined through shared memory
    assert r["kv_buffers"] >= 1, r


def test_plans_compile_for_sm90_within_shared_memory(tmp_path) -> None:
    results = _compile(_SCRIPT, CASES, tmp_path)
    for r in results:
        _check(r, SM90_MAX_SHARED)


_MIXED_SCRIPT = textwrap.dedent(_BUILD + """
    from pagedllm.kernels.paged_attention import _mixed_attn_kernel, plan_attention

    out = []
    for name, d, h, kvh in json.loads(sys.argv[1]):
        dec, pre = (plan_attention(num_reqs=200, max_query_len=mql, num_heads=h,
                                   num_kv_heads=kvh, block_size=16, sm_count=132,
                                   num_splits=1, head_dim=d, beside_decodes=True)
                    for mql in (1, 512))
        fp8 = name.endswith("fp8 KV")
        cache = "*fp8e4nv" if fp8 else "*bf16"
        sig = {"q_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache,
               "out_ptr": "*bf16", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
               "qsl_ptr": "*i32", "limits_ptr": "*i32", "scale_log2": "fp32"}
        for k in ("num_reqs", "num_heads", "num_pre_tiles", "stride_qt", "stride_qh",
                  "stride_ot", "stride_oh", "stride_cb", "stride_cs", "stride_ch",
                  "stride_bt"):
            sig[k] = "i32"
        sig["v_scale"] = "fp32"
        consts = dict(GQA=h // kvh, HEAD_DIM=d, DIM_P2=triton.next_power_of_2(d), KV_FP8=fp8,
                      BLOCK_SIZE=16, NUM_KV_HEADS=kvh, P_BLOCK_M=pre.block_m,
                      P_BLOCK_Q=pre.block_q, P_TILE_N=pre.tile_n, P_STAGES=pre.num_stages,
                      D_BLOCK_M=dec.block_m, D_BLOCK_Q=dec.block_q, D_TILE_N=dec.tile_n,
                      D_STAGES=dec.num_stages, F32_DOT=False, WHILE_LOOP=False,
                      USE_PDL=True, WINDOW=0, SOFTCAP=0.0)
        st = build(_mixed_attn_kernel, sig, consts, h, {
            "num_warps": 4, "num_stages": max(pre.num_stages, dec.num_stages)})
        out.append({"name": name, **st})
    print(json.dumps(out))
""")


def test_mixed_kernel_compiles_for_sm90_within_shared_memory(tmp_path) -> None:
    """The one-launch mixed-batch kernel holds both plans' programs: its two KV loops'
    buffers share shared memory (the Llama-3-8B shape needs 82 KB, little more than the
    decode plan's 74 KB alone), so two programs still fit on a multiprocessor."""
    cases = [("llama", 128, 32, 8), ("smollm", 64, 9, 3), ("head_dim 256", 256, 16, 8),
             ("llama fp8 KV", 128, 32, 8)]
    for r in _compile(_MIXED_SCRIPT, cases, tmp_path):
        _check(r, 100 * 1024)

