"""Compiling Triton kernels for sm_90 without a GPU, for the tests that check what the
H100/H200 compiler makes of a kernel (``test_attention_smem.py``,
``test_quant_gemm_sm90.py``, ``test_lora_kernels.py``): the interpreter runs what the
GPU compiler may reject, and cannot see registers, spills or shared memory.

:func:`run_script` (test side) runs a script in a subprocess without
``TRITON_INTERPRET`` and with an empty Triton cache (a real compile, not a hit); the
script calls :func:`compile_sm90` and prints a JSON value as its last line.
:func:`sass_loops` reads the instruction mix of a compiled kernel's loops
(``benchmarks/triton_sass.py`` prints it); :func:`pdl_trigger_follows_loads` where its
PDL trigger sits.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_script(script: str, tmp_path: Any, *args: str) -> Any:
    """Run ``script`` (``python -c``) with ``args``; its last stdout line, parsed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", script, *args], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def compile_sm90(kernel: Any, sig: dict[str, str], consts: dict[str, Any],
                 options: dict[str, Any], divisible: list[int]) -> tuple[Any, dict[str, int]]:
    """Compile ``kernel`` for sm_90 and run Triton's bundled ``ptxas -v`` on it:
    ``(compiled kernel, {"spill_stores", "registers", "shared"})``.  ``divisible``: the
    indices of ``sig``'s arguments that Triton's runtime would specialise as multiples of
    16 (pointers and aligned sizes/strides) -- without them the compiler builds a
    different kernel from the one that runs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "ptxas")
    src = ASTSource(kernel, signature={**sig, **{k: "constexpr" for k in consts}},
                    constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in divisible})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    try:
        res = subprocess.run([ptxas, "-v", "-arch=sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", res.stderr))
    regs = max(int(x) for x in re.findall(r"Used (\d+) registers", res.stderr))
    return k, {"spill_stores": spills, "registers": regs, "shared": k.metadata.shared}


_INSN = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")


def sass_loops(cubin: bytes) -> list[dict[str, Any]]:
    """The loops (backward branches) of a compiled kernel's SASS, each ``{"instructions":
    count, "ops": {opcode: count}}``, through the ``cuobjdump`` Triton ships.  Shared-memory
    traffic in a loop (``STS``, ``LDS``, ``BAR``) is a layout conversion per iteration."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)
    insns = [(int(m.group(1), 16), m.group(2)) for m in map(_INSN.match, sass.splitlines())
             if m]
    loops = []
    for addr, text in insns:
        target = re.search(r"BRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            body = [t for a, t in insns if int(target.group(1), 16) <= a <= addr]
            ops = Counter(t.split()[1 if t.startswith("@") else 0].split(".")[0]
                          for t in body)
            loops.append({"instructions": len(body), "ops": dict(ops)})
    return loops


def pdl_trigger_follows_loads(ptx: str) -> bool:
    """Whether a kernel's PDL trigger (``griddepcontrol.launch_dependents``, emitted by
    ``kernels/pdl.pdl_trigger``) comes after every global load of its PTX: the next kernel
    launches only once each program has read all it reads (``kernels/pdl.py``: where a
    GEMV's trigger belongs)."""
    trigger = ptx.find("griddepcontrol.launch_dependents")
    return trigger >= 0 and ptx.rfind("ld.global") < trigger
