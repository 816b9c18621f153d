"""The MLA decode and block-FP8 GEMM launch plans compile for an H100/H200 (sm_90) within
shared memory and without register spills (no GPU needed: ``sm90_compile``).

The interpreter cannot see registers or shared memory; an over-budget plan would fail at
its first launch with ``OutOfResources``, a spilling one would run slower.  The shapes
are DeepSeek-V2-Lite's decode at batch 64 (16 heads, split), V3's 128 heads (64-head
blocks, 8 warps) and a 4-token verify, each over a bf16 and an fp8 latent cache (bf16
queries: the kernel's fp16 products, ``KV_FP8 == 2``); the GEMM's default configurations
at a decode row and at 512 rows of a V3 projection.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.kernels.sm90_compile import run_script

pytest.importorskip("triton")

SM90_MAX_SHARED = 227 * 1024

_SCRIPT = textwrap.dedent(r"""
    import json, sys
    from tests.kernels.sm90_compile import compile_sm90
    from pagedllm.kernels.fp8_block_gemm import _fp8_block_gemm_kernel, default_block_config
    from pagedllm.kernels.int8_gemm import split_k_chunk
    from pagedllm.kernels.mla_decode import _mla_decode_kernel, plan_mla_decode

    cases = json.loads(sys.argv[1])
    out = []
    for reqs, mql, heads, kv_fp8 in cases["mla"]:
        p = plan_mla_decode(num_reqs=reqs, max_query_len=mql, num_heads=heads,
                            kv_lora_rank=512, kv_fp8=bool(kv_fp8))
        split = p.num_splits > 1
        sig = {"ql_ptr": "*bf16", "qp_ptr": "*bf16",
               "kv_ptr": "*fp8e4nv" if kv_fp8 else "*bf16", "bt_ptr": "*i32",
               "seq_lens_ptr": "*i32", "qsl_ptr": "*i32",
               "out_ptr": "*fp32" if split else "*bf16", "lse_ptr": "*fp32",
               "scale_log2": "fp32", "kv_scale": "fp32"}
        for k in ("num_heads", "num_splits", "num_reqs", "stride_qlt", "stride_qlh", "stride_qpt",
                  "stride_qph", "stride_kvb", "stride_kvs", "stride_bt", "stride_ot",
                  "stride_oh"):
            sig[k] = "i32"
        consts = dict(L=512, R=64, BLOCK_L=512, BLOCK_R=64, BLOCK_H=p.block_h,
                      BLOCK_Q=p.block_q, HEAD_BLOCKS=-(-heads // p.block_h),
                      BLOCK_N=p.block_n, BLOCK_SIZE=16, SPLIT=split, F32_DOT=False,
                      WHILE_LOOP=False, KV_FP8=2 if kv_fp8 else 0, SEARCH=mql > 1)
        # Pointers and the (multiple-of-64) strides are specialised as divisible by 16.
        div = [i for i, n in enumerate(sig) if sig[n].startswith("*")
               or (n.startswith("stride") and n != "stride_bt")]
        _, st = compile_sm90(_mla_decode_kernel, sig, consts,
                             {"num_warps": p.num_warps, "num_stages": p.num_stages}, div)
        out.append({"case": f"mla {reqs} x {mql} x {heads}{' fp8' if kv_fp8 else ''}",
                    **st})
    for m, n, k in cases["gemm"]:
        bm, bn, w, stages, split, swap = default_block_config(m, n, k)
        split = split_k_chunk(k, 128, split)[1]
        sig = {"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "wq_ptr": "*fp8e4nv",
               "ws_ptr": "*fp32", "bias_ptr": "*fp32",
               "out_ptr": "*fp32" if split > 1 else "*bf16"}
        for a in ("M", "N", "K", "stride_xm", "stride_xsm", "stride_wn", "stride_wsn",
                  "stride_om", "stride_os", "groups_per_split"):
            sig[a] = "i32"
        consts = dict(BLOCK_M=bm, BLOCK_N=bn, GROUP=128, W_BLOCK_N=128, SWAP=bool(swap),
                      HAS_BIAS=False, WHILE_LOOP=False)
        div = [i for i, a in enumerate(sig) if sig[a].startswith("*") or a in
               ("N", "K", "stride_xm", "stride_wn", "stride_om", "stride_os")]
        _, st = compile_sm90(_fp8_block_gemm_kernel, sig, consts,
                             {"num_warps": w, "num_stages": stages}, div)
        out.append({"case": f"gemm {m} x {n} x {k}", **st})
    print(json.dumps(out))
""")


def test_plans_fit_sm90(tmp_path) -> None:
    # [requests, max_query_len, heads, fp8 cache]: decodes, a 4-token verify, and a
    # 512-token chunk graph's launch (one query a program).
    cases = {"mla": [[64, 1, 16, 0], [256, 1, 128, 0], [64, 4, 16, 0],
                     [64, 1, 16, 1], [256, 1, 128, 1], [64, 4, 16, 1],
                     [256, 512, 16, 0], [256, 512, 16, 1]],
             "gemm": [[1, 4096, 7168], [512, 24576, 1536]]}
    res = run_script(_SCRIPT, tmp_path, json.dumps(cases))
    for r in res:
        print(r)
        assert r["shared"] <= SM90_MAX_SHARED, r
        assert r["spill_stores"] == 0, r
