"""What a Triton kernel compiles to on an H100/H200, on a machine without a GPU: registers,
spills and the instruction mix of each loop of its SASS (sm_90a; Triton's own compiler and
the ``ptxas`` / ``cuobjdump`` its wheel ships).

Not a timing: a loop's instruction count and its shared-memory traffic (``STS``/``LDS``/
``BAR``, the sign of a layout conversion per iteration) say where a kernel will be slow
before device time is spent on it.  Example: the striped GEMV's zero-point path used to
convert the zero points through shared memory every step (129 ``STS``, 128 ``LDS``, 34
``BAR`` in a loop of 792 instructions against the symmetric loop's 383), which matched its
125.5 µs against 35.6 µs on an H100.

Usage (repository root): ``python benchmarks/triton_sass.py [--zero] [--bits 4]
[--config BM,BN,STRIPES,WARPS,AHEAD] [--k 4096]`` for the striped GEMV
(``kernels/wna16_stripe.py``); other kernels through :func:`sass_stats`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_INSN = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")


def sass_stats(fn: Any, signature: dict[str, str], constexprs: dict[str, Any],
               aligned: list[str], num_warps: int = 4, num_stages: int = 1,
               arch: int = 90) -> dict[str, Any]:
    """Compile ``fn`` (a ``@triton.jit`` function) for ``sm_<arch>``: ``signature`` maps
    every runtime argument to its Triton type (``"*bf16"``, ``"i32"``), ``constexprs``
    the rest to values; ``aligned`` names the arguments the launcher would specialise as
    divisible by 16 (pointers, strides), which changes the layouts Triton picks.

    Returns ``{"registers", "spill_bytes", "instructions", "loops": [{"instructions",
    "ops"}]}`` with ``ops`` the ten commonest opcodes of each backward-branch loop."""
    sig = dict(signature)
    sig.update({k: "constexpr" for k in constexprs})
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                            options={"num_warps": num_warps, "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        info = subprocess.run([os.path.join(_BIN, "ptxas"), "-v", f"--gpu-name=sm_{arch}a",
                               ptx, "-o", cubin], capture_output=True, text=True,
                              check=True).stderr
        sass = subprocess.run([os.path.join(_BIN, "cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True, check=True).stdout
    regs = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    insns = [(int(m.group(1), 16), m.group(2)) for m in map(_INSN.match, sass.splitlines())
             if m]
    loops = []
    for addr, text in insns:
        target = re.search(r"BRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            body = [t for a, t in insns if int(target.group(1), 16) <= a <= addr]
            ops = Counter(t.split()[1 if t.startswith("@") else 0].split(".")[0]
                          for t in body)
            loops.append({"instructions": len(body), "ops": dict(ops.most_common(10))})
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spills.group(1)) if spills else None,
            "instructions": len(insns), "loops": loops}


def stripe_gemv(zero: bool, bits: int, config: tuple[int, ...], k: int) -> dict[str, Any]:
    """:func:`sass_stats` of ``wna16_stripe._stripe_gemv_kernel`` at one launch config
    (bf16 activations and scales, fp32 zero points, group 128, one K chunk)."""
    from pagedllm.kernels import wna16_stripe

    bm, bn, stripes, warps, ahead = config
    signature = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*fp32",
                 "out_ptr": "*bf16", "M": "i32", "N": "i32", "stride_xm": "i32",
                 "stride_qn": "i32", "stride_sn": "i32", "stride_zn": "i32",
                 "stride_om": "i32", "stride_os": "i32"}
    consts = {"K": k, "BITS": bits, "GROUP": 128, "HAS_ZERO": zero, "BLOCK_M": bm,
              "BLOCK_N": bn, "STRIPES": stripes, "K_CHUNK": k, "EVEN": True,
              "USE_PDL": False, "AHEAD": bool(ahead)}
    aligned = [n for n in signature if n.endswith("_ptr") or n.startswith("stride")] + ["N"]
    return sass_stats(wna16_stripe._stripe_gemv_kernel, signature, consts, aligned, warps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zero", action="store_true", help="zero points (default: symmetric)")
    ap.add_argument("--bits", type=int, default=4, help="weight bits, 4 or 8 (default 4)")
    ap.add_argument("--config", default="1,8,8,4,0",
                    help="BLOCK_M,BLOCK_N,STRIPES,WARPS,AHEAD (default 1,8,8,4,0)")
    ap.add_argument("--k", type=int, default=4096, help="input features (default 4096)")
    a = ap.parse_args()
    cfg = tuple(int(v) for v in a.config.split(","))
    s = stripe_gemv(a.zero, a.bits, cfg, a.k)
    print(f"registers {s['registers']}, spills {s['spill_bytes']} B, "
          f"{s['instructions']} instructions")
    for i, loop in enumerate(s["loops"]):
        print(f"loop {i}: {loop['instructions']} instructions {loop['ops']}")


if __name__ == "__main__":
    main()
