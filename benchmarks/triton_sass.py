"""What a Triton kernel compiles to on an H100/H200, on a machine without a GPU: registers,
spills and the instruction mix of each loop of its SASS (sm_90a, through Triton's own
compiler and the ``ptxas`` / ``cuobjdump`` its wheel ships; the helpers live in
``tests/kernels/sm90_compile.py``, which the sm_90 tests share).

Not a timing: a loop's instruction count and its shared-memory traffic (``STS``/``LDS``/
``BAR``: a layout conversion per iteration) say where a kernel will be slow before device
time is spent on it.  Example: the striped GEMV's zero-point path used to convert the
zero points through shared memory every step (129 ``STS``, 128 ``LDS``, 34 ``BAR`` in a
loop of 792 instructions against the symmetric loop's 383), which matched its 125.5 µs
against 35.6 µs on an H100.

The K-major GEMV (``kernels/wna16_kmajor.py``, the zero-point layers' decode path) had
the other problem: the zero folded into its loop took 126 registers at one row against
the symmetric 64, halving the programs an SM holds; both now add the zero points outside
the inner loop.

Usage (repository root): ``python benchmarks/triton_sass.py [--kernel stripe|kmajor]
[--zero] [--bits 4] [--config ...] [--k 4096]``: the striped W4A16 GEMV
(``kernels/wna16_stripe.py``, config ``BM,BN,STRIPES,WARPS,AHEAD``) or the K-major one
(config ``BM,BN,BK,WARPS,AHEAD``, 4 bits, split into 4 chunks).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.kernels.sm90_compile import compile_sm90, sass_loops  # noqa: E402


def stripe_gemv(zero: bool, bits: int, config: tuple[int, ...], k: int) -> dict[str, Any]:
    """Registers, spills and loops of ``wna16_stripe._stripe_gemv_kernel`` at one launch
    config (bf16 activations and scales, fp32 zero points, group 128, one K chunk), with
    the divisibility the launcher specialises on."""
    from pagedllm.kernels import wna16_stripe

    bm, bn, stripes, warps, ahead = config
    sig = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*fp32",
           "out_ptr": "*bf16", "M": "i32", "N": "i32", "stride_xm": "i32",
           "stride_qn": "i32", "stride_sn": "i32", "stride_zn": "i32", "stride_om": "i32",
           "stride_os": "i32"}
    consts = {"K": k, "BITS": bits, "GROUP": 128, "HAS_ZERO": zero, "BLOCK_M": bm,
              "BLOCK_N": bn, "STRIPES": stripes, "K_CHUNK": k, "EVEN": True,
              "USE_PDL": False, "AHEAD": bool(ahead)}
    divisible = [i for i, n in enumerate(sig) if n.endswith("_ptr")
                 or n.startswith("stride") or n == "N"]
    kernel, stats = compile_sm90(wna16_stripe._stripe_gemv_kernel, sig, consts,
                                 {"num_warps": warps, "num_stages": 1}, divisible)
    return {**stats, "loops": sass_loops(kernel.asm["cubin"])}


def kmajor_gemv(zero: bool, config: tuple[int, ...], k: int) -> dict[str, Any]:
    """The same for ``wna16_kmajor._kmajor_gemv_kernel`` (group 128, K in 4 chunks)."""
    from pagedllm.kernels import wna16_kmajor

    bm, bn, bk, warps, ahead = config
    sig = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*bf16",
           "out_ptr": "*fp32", "M": "i32", "N": "i32", "stride_xm": "i32",
           "stride_om": "i32", "stride_os": "i32"}
    k_chunk = k // 4
    consts = {"K": k, "GROUP": 128, "HAS_ZERO": zero, "BLOCK_M": bm, "BLOCK_N": bn,
              "BLOCK_K": bk, "K_CHUNK": k_chunk, "EVEN_N": True, "AHEAD": bool(ahead),
              "WHILE_LOOP": False, "USE_PDL": False}
    divisible = [i for i, n in enumerate(sig) if n != "M"]
    kernel, stats = compile_sm90(wna16_kmajor._kmajor_gemv_kernel, sig, consts,
                                 {"num_warps": warps, "num_stages": 1}, divisible)
    return {**stats, "loops": sass_loops(kernel.asm["cubin"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=("stripe", "kmajor"), default="stripe",
                    help="the striped or the K-major W4A16 GEMV (default stripe)")
    ap.add_argument("--zero", action="store_true", help="zero points (default: symmetric)")
    ap.add_argument("--bits", type=int, default=4, help="weight bits, 4 or 8 (default 4)")
    ap.add_argument("--config", default=None,
                    help="stripe: BLOCK_M,BLOCK_N,STRIPES,WARPS,AHEAD (default 1,8,8,4,0); "
                         "kmajor: BLOCK_M,BLOCK_N,BLOCK_K,WARPS,AHEAD (default "
                         "1,128,64,4,1)")
    ap.add_argument("--k", type=int, default=4096, help="input features (default 4096)")
    a = ap.parse_args()
    default = "1,8,8,4,0" if a.kernel == "stripe" else "1,128,64,4,1"
    cfg = tuple(int(v) for v in (a.config or default).split(","))
    s = (stripe_gemv(a.zero, a.bits, cfg, a.k) if a.kernel == "stripe"
         else kmajor_gemv(a.zero, cfg, a.k))
    print(f"registers {s['registers']}, spill stores {s['spill_stores']} B, "
          f"shared {s['shared']} B")
    for i, loop in enumerate(s["loops"]):
        top = sorted(loop["ops"].items(), key=lambda kv: -kv[1])[:10]
        print(f"loop {i}: {loop['instructions']} instructions {dict(top)}")


if __name__ == "__main__":
    main()
