"""Matrix-vector product for batch-1 decode: ``y = x W^T (+ b)`` with one row in ``x``,
optionally with the gated-MLP activation fused in front (``x = silu(g) * u``) or with the
decoder's (residual add +) RMSNorm fused in front (``x = rmsnorm(x + r) * g``).

At decode batch 1 a linear layer is a pure read of its weight: 2 bytes per weight, one
FMA each.  For Llama's thin projections (``qkv``: 6144 x 4096, ``o_proj``: 4096 x 4096)
cuBLAS picks split-K kernels that read at ~3 TB/s and add a reduce kernel each; this
kernel is one launch.  Fusing SiLU-and-mul into ``down_proj``'s read of its input removes
the activation kernel (and its round trip through memory) from every layer; fusing the
pre-attention and pre-MLP RMSNorms into the ``qkv`` and ``gate_up`` reads removes two norm
kernels per layer.  For the norm every program first sums the squares of the whole row
itself, then reads the row again chunk by chunk in its K loop: redundant reads of a few KB
per program (mostly cache hits, expected) in exchange for no extra launch and no
synchronisation between programs.  ``PAGEDLLM_GEMV_NORM=0`` (``layers/linear.py``) turns
the fusion off for A/B runs.

Layout: each program owns ``BLOCK_N`` consecutive output features and walks the whole K
dimension in ``BLOCK_K`` steps, so every weight row is read as one contiguous stream and
no partial sums cross programs (no split-K workspace, no atomics: results are
deterministic for a given launch configuration).  The accumulator is an elementwise
``[BLOCK_N, BLOCK_K]`` fp32 tile, reduced along K once at the end, so the loop body is
loads and FMAs only.  K is a compile-time constant (a layer's input size: a handful per
model), which lets the K loop be unrolled.

The sum is ordered differently from cuBLAS's, so outputs differ from ``F.linear`` within
fp32 accumulation error, then one rounding to the output dtype.  The fused norm rounds
like ``kernels/norm.py`` step for step, but its fp32 sum of squares is ordered differently
too, so on a near-tie an element of the normalised input can round the other way.
Whether a layer uses this kernel depends only on its row count (a host int), never on
data: CUDA-graph capture and eager runs of the same batch size take the same path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedllm.kernels.pdl import pdl_launch_args, pdl_trigger, pdl_wait


@triton.jit
def _load_sum(x_ptr, r_ptr, ks, k_ok, HAS_RES: tl.constexpr, MASKED: tl.constexpr):
    """``x + r`` for the chunk ``ks`` in the activation dtype (rounded as
    ``kernels/norm.py`` rounds the residual sum), or ``x`` alone without a residual."""
    if MASKED:
        s = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
    else:
        s = tl.load(x_ptr + ks)
    if HAS_RES:
        if MASKED:
            r = tl.load(r_ptr + ks, mask=k_ok, other=0.0)
        else:
            r = tl.load(r_ptr + ks)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(s.dtype)
    return s


@triton.jit
def _load_x(x_ptr, r_ptr, g_ptr, rstd, ks, k_ok, K: tl.constexpr, SILU_MUL: tl.constexpr,
            NORM: tl.constexpr, HAS_RES: tl.constexpr, MASKED: tl.constexpr):
    """The input chunk ``ks`` in fp32.  With ``SILU_MUL``, ``x = silu(gate) * up`` from
    ``[gate | up]`` (K each), rounded exactly as ``kernels/activation.py`` rounds it: silu
    in fp32 -> dtype, then the product -> dtype.  With ``NORM``, ``x = rmsnorm(x (+ r)) *
    g`` given the row's ``rstd``, rounded exactly as ``kernels/norm.py`` rounds it: the
    normalised value -> dtype, then the product with the norm weight ``g`` -> dtype."""
    if SILU_MUL:
        if MASKED:
            g = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
            u = tl.load(x_ptr + K + ks, mask=k_ok, other=0.0)
        else:
            g = tl.load(x_ptr + ks)
            u = tl.load(x_ptr + K + ks)
        gf = g.to(tl.float32)
        act = tl.div_rn(gf, 1.0 + tl.exp(-gf)).to(g.dtype)
        return (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype).to(tl.float32)
    if NORM:
        s = _load_sum(x_ptr, r_ptr, ks, k_ok, HAS_RES, MASKED)
        n = (s.to(tl.float32) * rstd).to(s.dtype)
        if MASKED:
            nw = tl.load(g_ptr + ks, mask=k_ok, other=0.0)
        else:
            nw = tl.load(g_ptr + ks)
        return (n.to(tl.float32) * nw.to(tl.float32)).to(s.dtype).to(tl.float32)
    if MASKED:
        return tl.load(x_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
    return tl.load(x_ptr + ks).to(tl.float32)


@triton.jit
def _row_rstd(x_ptr, r_ptr, ro_ptr, eps, store_sum, K: tl.constexpr, HAS_RES: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """``1 / sqrt(mean(s^2) + eps)`` of the row ``s = x (+ r)`` (as ``kernels/norm.py``:
    squares of the rounded sum, in fp32).  Where ``HAS_RES and store_sum`` the sum is
    written to ``ro_ptr``: a buffer no program reads, since others may still read ``x`` and
    ``r``."""
    rk = tl.arange(0, BLOCK_K)
    ssq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        s = _load_sum(x_ptr, r_ptr, ks, ks < K, HAS_RES, K % BLOCK_K != 0)
        if HAS_RES:
            tl.store(ro_ptr + ks, s, mask=(ks < K) & store_sum)
        sf = s.to(tl.float32)
        ssq += sf * sf
    return tl.math.rsqrt(tl.sum(ssq, axis=0) / K + eps)


@triton.jit
def _load_w(w_rows, ks, K: tl.constexpr, BLOCK_K: tl.constexpr):
    if K % BLOCK_K == 0:  # static: unmasked, vectorised loads
        return tl.load(w_rows + ks[None, :])
    return tl.load(w_rows + ks[None, :], mask=ks[None, :] < K, other=0.0)


@triton.jit
def _gemv_kernel(x_ptr, r_ptr, g_ptr, ro_ptr, w_ptr, b_ptr, y_ptr, N, stride_wn, eps,
                 K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr,
                 NORM: tl.constexpr, HAS_RES: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRE_K: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """``y = W @ f(x) (+ b)``; ``f`` is the identity, SiLU-and-mul (``SILU_MUL``) or the
    RMSNorm with norm weight ``g`` of ``x`` or, with ``HAS_RES``, of ``x + r`` (``NORM``;
    program 0 then writes ``x + r`` to ``ro``).  Pointers a mode does not use are
    ignored."""
    pdl_trigger(USE_PDL)
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    # Out-of-range rows re-read row N-1 instead of being masked, so that the weight loads
    # along K stay unmasked and vectorised; those rows are never stored.
    rn_safe = tl.minimum(rn, N - 1).to(tl.int64)
    w_rows = w_ptr + rn_safe[:, None] * stride_wn
    # The first PRE_K columns of the weights are fetched before waiting for the previous
    # kernel (PDL, kernels/pdl.py): weights are never written by a kernel, x is.
    rp = tl.arange(0, PRE_K)
    w0 = _load_w(w_rows, rp, K, PRE_K)
    pdl_wait(USE_PDL)
    rstd = 1.0  # read only in NORM mode
    if NORM:
        # Program 0 writes the residual sum (a predicated store: no branch in the loop).
        rstd = _row_rstd(x_ptr, r_ptr, ro_ptr, eps, pid == 0, K, HAS_RES, BLOCK_K)
    x0 = _load_x(x_ptr, r_ptr, g_ptr, rstd, rp, rp < K, K, SILU_MUL, NORM, HAS_RES,
                 K % PRE_K != 0)
    out = tl.sum(w0.to(tl.float32) * x0[None, :], axis=1)
    if PRE_K < K:
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(PRE_K, K, BLOCK_K):
            ks = k0 + rk
            w = _load_w(w_rows, ks, K, BLOCK_K)
            x = _load_x(x_ptr, r_ptr, g_ptr, rstd, ks, ks < K, K, SILU_MUL, NORM, HAS_RES,
                        K % BLOCK_K != 0)
            acc += w.to(tl.float32) * x[None, :]
        out += tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, out.to(y_ptr.dtype.element_ty), mask=n_mask)


def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps).  8 output rows per program gives 512+ programs for
    N >= 4096 (several per SM, enough bytes in flight).  In an H200 sweep of the
    Llama-3-8B projections (``benchmarks/gemm_sweep.py``, graph-timed, 24 configurations
    each) this was within 1-2 µs of the best everywhere; a run with the per-shape "best"
    configurations (and another change) had a slower decode step, so one config stays."""
    return 8, min(512, triton.next_power_of_2(k)), 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, silu_mul: bool = False,
         config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``x: [1, K]`` (``[1, 2K]`` = ``[gate | up]`` when ``silu_mul``; contiguous),
    ``weight: [N, K]`` with contiguous rows, ``bias: [N]`` or None -> ``[1, N]`` in
    ``x``'s dtype.  ``config`` overrides :func:`gemv_config` (for tuning)."""
    _check_row(x, weight, 2 if silu_mul else 1, f"silu_mul={silu_mul}")
    out = _output(x, weight, out)
    _launch(x, weight, bias, out, config, silu_mul=silu_mul)
    return out


def gemv_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                 eps: float, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, res_out: torch.Tensor | None = None,
                 config: tuple[int, int, int] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (``s = x`` without one); returns ``(h W^T + b, s)`` with
    ``h = rms_norm(s) * norm_weight`` rounded as ``kernels/norm.py`` rounds it, i.e. what
    ``fused_add_rms_norm`` (or ``rms_norm``) followed by :func:`gemv` computes, in one
    kernel.  ``x`` and ``residual``: ``[1, K]`` contiguous, ``norm_weight: [K]``; the
    rest as in :func:`gemv`.  With a residual, ``s`` goes to ``res_out`` (a new tensor if
    None; it must not alias an input, which other programs are still reading) and the
    inputs are left intact; without one ``s`` is ``x`` itself (``res_out`` unused)."""
    _check_row(x, weight, 1, "rmsnorm")
    k = weight.shape[1]
    if norm_weight.shape != (k,) or not norm_weight.is_contiguous():
        raise ValueError(f"gemv_rmsnorm: norm weight {tuple(norm_weight.shape)} does not "
                         f"match K={k} or is not contiguous")
    for name, t in (("residual", residual), ("res_out", res_out)):
        if t is not None and (t.shape != x.shape or not t.is_contiguous()):
            raise ValueError(f"gemv_rmsnorm: {name} {tuple(t.shape)} does not match x "
                             f"{tuple(x.shape)} or is not contiguous")
    out = _output(x, weight, out)
    if residual is None:
        res_out = x
    elif res_out is None:
        res_out = torch.empty_like(x)
    _launch(x, weight, bias, out, config, norm=(residual, norm_weight, eps, res_out))
    return out, res_out


def _check_row(x: torch.Tensor, weight: torch.Tensor, k_mult: int, mode: str) -> None:
    """``x`` must be one contiguous row of ``k_mult * K`` inputs for ``weight [N, K]``."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv takes exactly one row, got x of shape {tuple(x.shape)}")
    if x.shape[1] != k_mult * k or weight.stride(1) != 1 or not x.is_contiguous():
        raise ValueError(f"gemv: x {tuple(x.shape)} does not match weight {(n, k)} "
                         f"({mode}) or is not contiguous")


def _output(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        out = torch.empty(1, weight.shape[0], dtype=x.dtype, device=x.device)
    return out


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            out: torch.Tensor, config: tuple[int, int, int] | None, silu_mul: bool = False,
            norm: tuple[torch.Tensor | None, torch.Tensor, float, torch.Tensor] | None = None
            ) -> None:
    """Launch :func:`_gemv_kernel`; ``norm`` is ``(residual, norm_weight, eps, res_out)``
    for the RMSNorm mode (the kernel ignores the pointers of modes that are off)."""
    n, k = weight.shape
    residual, norm_weight, eps, res_out = norm or (None, x, 0.0, x)
    block_n, block_k, warps = config or gemv_config(n, k)
    # Columns fetched ahead of the PDL wait: a multiple of the K step (A/B knob for now).
    pre_k = min(block_k * int(os.environ.get("PAGEDLLM_GEMV_PREFETCH", "1")),
                triton.next_power_of_2(k))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight, res_out, weight,
        bias if bias is not None else weight, out, n, weight.stride(0), eps, K=k,
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, NORM=norm is not None,
        HAS_RES=residual is not None, BLOCK_N=block_n, BLOCK_K=block_k, PRE_K=pre_k,
        num_warps=warps, **pdl_launch_args(x.device))
