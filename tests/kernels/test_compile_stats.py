"""The start-up count of Triton compilations (``kernels/compile_stats.py``): a real
compile for an sm_90 target (no GPU needed: Triton lowers to PTX and runs its bundled
ptxas), then the same kernel again from the on-disk cache.

The compile runs in a fresh interpreter: once a test in this process has run a kernel
under ``TRITON_INTERPRET=1``, Triton's interpreter has patched ``triton.language`` and a
real compile in the same process fails in ``make_ir`` (seen when ``tests/sample`` runs
first)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

_CHILD = textwrap.dedent('''
    import sys
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from pagedllm.kernels import compile_stats

    triton.knobs.cache.dir = sys.argv[1]
    seen = []
    triton.knobs.compilation.listener = lambda **kw: seen.append(kw["cache_hit"])

    def add_one(x_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1)

    # JITFunction directly: under TRITON_INTERPRET=1 (the CI default) @triton.jit would
    # give an interpreted function, which cannot be compiled.
    _add_one = JITFunction(add_one)

    compile_stats.install()
    compile_stats.install()  # idempotent: one listener, counts once
    src = ASTSource(_add_one, signature={"x_ptr": "*fp32", "BLOCK": "constexpr"},
                    constexprs={"BLOCK": 64})
    target = GPUTarget("cuda", 90, 32)
    triton.compile(src, target=target)
    first = compile_stats.snapshot()
    assert (first.compiled, first.cache_hits) == (1, 0), first
    assert first.compile_s > 0, first
    triton.compile(src, target=target)
    second = compile_stats.snapshot()
    assert (second.compiled, second.cache_hits) == (1, 1), second
    assert second.compile_s == first.compile_s, (first, second)
    assert seen == [False, True], seen  # the listener that was there before hears both
    print("ok")
''')


def test_counts_compiles_and_cache_hits(tmp_path):
    script = tmp_path / "compile_child.py"  # Triton reads a kernel's source from its file
    script.write_text(_CHILD)
    cache = tmp_path / "cache"
    r = subprocess.run([sys.executable, str(script), str(cache)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
