"""The attention plans compile for an H100/H200 (sm_90) and fit its shared memory.

No GPU needed: a subprocess without ``TRITON_INTERPRET`` compiles ``_paged_attn_kernel``
for an sm_90 target with each launch plan ``plan_attention`` picks (Triton lowers to PTX
and runs its bundled ptxas) and reports the shared memory each needs.  A plan that asks
for more than a block may have (227 KB) would fail at its first launch on the device with
``OutOfResources``; this catches it in CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SM90_MAX_SHARED = 227 * 1024  # bytes of dynamic shared memory per block on sm_90

# (name, head_dim, num_heads, num_kv_heads, num_reqs, max_query_len, q_filter)
CASES = [
    ("llama decode, unsplit", 128, 32, 8, 256, 1, 0),
    ("llama decode, split", 128, 32, 8, 1, 1, 0),
    ("llama mixed: decodes (two launches)", 128, 32, 8, 200, 1, 1),
    ("llama mixed: prompt chunks (two launches)", 128, 32, 8, 200, 512, 2),
    ("smollm decode, unsplit", 64, 9, 3, 256, 1, 0),
    ("head_dim 256 decode, unsplit", 256, 16, 8, 256, 1, 0),
]

_SCRIPT = textwrap.dedent("""
    import json, sys
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton
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
               "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "scale_log2": "fp32"}
        for k in ("num_reqs", "num_heads", "num_splits", "stride_qt", "stride_qh",
                  "stride_ot", "stride_oh", "stride_cb", "stride_cs", "stride_ch",
                  "stride_bt"):
            sig[k] = "i32"
        consts = dict(GQA=h // kvh, HEAD_DIM=d, DIM_P2=triton.next_power_of_2(d),
                      BLOCK_SIZE=16, BLOCK_M=p.block_m, BLOCK_Q=p.block_q,
                      TILE_N=p.tile_n, SPLIT=split, F32_DOT=False, WHILE_LOOP=False,
                      Q_FILTER=q_filter, DECODE=mql == 1 and q_filter == 0, USE_PDL=True)
        sig.update({k: "constexpr" for k in consts})
        src = ASTSource(_paged_attn_kernel, signature=sig, constexprs=consts)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": p.num_warps, "num_stages": p.num_stages})
        out.append({"name": name, "plan": repr(p), "shared": k.metadata.shared})
    print(json.dumps(out))
""")


def _compile(script: str, cases: list, tmp_path) -> list[dict]:
    """Run ``script`` (which prints a JSON list, one entry per case) in a subprocess
    without the interpreter, with an empty Triton cache (a real compile, not a hit)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", script, json.dumps(cases)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    return results


def test_plans_compile_for_sm90_within_shared_memory(tmp_path) -> None:
    results = _compile(_SCRIPT, CASES, tmp_path)
    for r in results:
        assert 0 < r["shared"] <= SM90_MAX_SHARED, r


_MIXED_SCRIPT = textwrap.dedent("""
    import json, sys
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton
    from pagedllm.kernels.paged_attention import _mixed_attn_kernel, plan_attention

    out = []
    for name, d, h, kvh in json.loads(sys.argv[1]):
        dec, pre = (plan_attention(num_reqs=200, max_query_len=mql, num_heads=h,
                                   num_kv_heads=kvh, block_size=16, sm_count=132,
                                   num_splits=1, head_dim=d, beside_decodes=True)
                    for mql in (1, 512))
        sig = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
               "out_ptr": "*bf16", "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32",
               "qsl_ptr": "*i32", "scale_log2": "fp32"}
        for k in ("num_reqs", "num_heads", "num_pre_tiles", "stride_qt", "stride_qh",
                  "stride_ot", "stride_oh", "stride_cb", "stride_cs", "stride_ch",
                  "stride_bt"):
            sig[k] = "i32"
        consts = dict(GQA=h // kvh, HEAD_DIM=d, DIM_P2=triton.next_power_of_2(d),
                      BLOCK_SIZE=16, NUM_KV_HEADS=kvh, P_BLOCK_M=pre.block_m,
                      P_BLOCK_Q=pre.block_q, P_TILE_N=pre.tile_n, P_STAGES=pre.num_stages,
                      D_BLOCK_M=dec.block_m, D_BLOCK_Q=dec.block_q, D_TILE_N=dec.tile_n,
                      D_STAGES=dec.num_stages, F32_DOT=False, WHILE_LOOP=False,
                      USE_PDL=True)
        sig.update({k: "constexpr" for k in consts})
        src = ASTSource(_mixed_attn_kernel, signature=sig, constexprs=consts)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={
            "num_warps": 4, "num_stages": max(pre.num_stages, dec.num_stages)})
        out.append({"name": name, "shared": k.metadata.shared})
    print(json.dumps(out))
""")


def test_mixed_kernel_compiles_for_sm90_within_shared_memory(tmp_path) -> None:
    """The one-launch mixed-batch kernel holds both plans' programs: its two KV loops'
    buffers share shared memory (the Llama-3-8B shape needs 82 KB, little more than the
    decode plan's 74 KB alone), so two programs still fit on a multiprocessor."""
    cases = [("llama", 128, 32, 8), ("smollm", 64, 9, 3), ("head_dim 256", 256, 16, 8)]
    for r in _compile(_MIXED_SCRIPT, cases, tmp_path):
        assert 0 < r["shared"] <= 100 * 1024, r
