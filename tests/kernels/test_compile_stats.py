"""The start-up count of Triton compilations (``kernels/compile_stats.py``): a real
compile for an sm_90 target (no GPU needed: Triton lowers to PTX and runs its bundled
ptxas), then the same kernel again from the on-disk cache."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")


def test_counts_compiles_and_cache_hits(tmp_path, monkeypatch):
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedllm.kernels import compile_stats

    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    seen = []
    monkeypatch.setattr(triton.knobs.compilation, "listener",
                        lambda **kw: seen.append(kw["cache_hit"]))
    monkeypatch.setattr(compile_stats, "_installed", False)
    monkeypatch.setattr(compile_stats, "_stats", compile_stats.CompileStats())

    from triton.runtime.jit import JITFunction

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
    assert (first.compiled, first.cache_hits) == (1, 0)
    assert first.compile_s > 0
    triton.compile(src, target=target)
    second = compile_stats.snapshot()
    assert (second.compiled, second.cache_hits) == (1, 1)
    assert second.compile_s == first.compile_s
    assert seen == [False, True]  # the listener that was there before still hears both
