"""RMSNorm, optionally fused with the residual add (vLLM's ``fused_add_rms_norm``), and
Gemma's variant (``gemma_norm``: ``(1 + w)`` weights, all-fp32 math, post-norm adds).

Numerics follow Hugging Face's ``LlamaRMSNorm`` step for step so greedy outputs match
token for token: the residual sum is rounded to the activation dtype first (as
``residual + hidden`` is in the model dtype), the variance is taken in fp32 from that
rounded sum, the normalised value is rounded to the activation dtype, and only then
multiplied by the weight (one more rounding, as ``weight * x.to(dtype)`` does).

One program per row; the whole row lives in registers (hidden sizes up to 64k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.fp8_quant import round_e4m3
from pagedllm.kernels.pdl import pdl_launch_args, pdl_trigger, pdl_wait
from pagedllm.kernels.quant_common import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro,
    n_cols, eps, q_ptr, s_ptr, stride_q, min_scale, HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr, QUANT: tl.constexpr = False,
    FP8_MAX_C: tl.constexpr = FP8_MAX,
):
    pdl_trigger(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # The weight is read before waiting for the previous kernel (PDL, kernels/pdl.py):
    # at batch 1 this kernel is one program, and its time is its chain of memory round
    # trips; the weight's is then off that chain.
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    y = (xf * tl.math.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    out = (y.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)
    if QUANT:  # the stored row's per-token e4m3 quantisation (kernels/fp8_quant.py's)
        of = out.to(tl.float32)
        scale = tl.maximum(tl.div_rn(tl.max(tl.where(mask, tl.abs(of), 0.0), 0), FP8_MAX_C),
                           min_scale)
        tl.store(s_ptr + row, scale)
        q = round_e4m3(tl.div_rn(of, scale))
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """View as ``[rows, hidden]``; the last dim must be contiguous (rows may be strided)."""
    assert t.stride(-1) == 1, "last dimension must be contiguous"
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float, out: torch.Tensor, res_out: torch.Tensor | None,
            quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    assert weight.shape == (n_cols,), (weight.shape, n_cols)
    if n_rows == 0:
        return
    o2 = _rows(out)
    r2 = _rows(residual) if residual is not None else x2
    ro2 = _rows(res_out) if res_out is not None else o2
    block = triton.next_power_of_2(n_cols)
    q, s = quant if quant is not None else (o2, o2)
    _rms_norm_kernel[(n_rows,)](
        x2, r2, weight, o2, ro2, x2.stride(0), r2.stride(0), o2.stride(0), ro2.stride(0),
        n_cols, eps, q, s, q.stride(0), FP8_MIN_SCALE, HAS_RESIDUAL=residual is not None,
        BLOCK=block, num_warps=min(16, max(1, block // 256)), QUANT=quant is not None,
        **pdl_launch_args(x.device),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """``weight * normalise(x)`` over the last dim; ``x`` is ``[..., hidden]`` with a
    contiguous last dim (e.g. ``[T, hidden]``, or ``[T, heads, head_dim]`` for per-head
    q/k norms).  Returns a new tensor (or ``out``) in ``x``'s dtype.

    ``out`` may alias ``x`` (in place): each program reads its row before writing it.
    """
    if out is None:
        out = torch.empty_like(x)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, *, inplace: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual``; returns ``(rms_norm(s) * weight, s)``.

    With ``inplace=True`` the normalised output overwrites ``x`` and ``s`` overwrites
    ``residual`` (vLLM's ``fused_add_rms_norm`` convention, no allocation -- handy inside
    CUDA graphs); the returned tensors are then ``(x, residual)``.
    """
    assert residual.shape == x.shape, (residual.shape, x.shape)
    if inplace:
        out, res_out = x, residual
    else:
        out, res_out = torch.empty_like(x), torch.empty_like(residual)
    _launch(x, residual, weight, eps, out, res_out)
    return out, res_out


def rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor,
                                      torch.Tensor]:
    """:func:`rms_norm` (``residual`` None) or :func:`fused_add_rms_norm` that also
    quantises each normalised row to e4m3 per token, in the same launch:
    ``(out, new residual or None, q [T, H] e4m3, scale [T, 1] fp32)``.  ``out`` is
    bit-identical to the plain kernels' and ``(q, scale)`` to
    ``kernels/fp8_quant.quantize_fp8_per_token(out)``: the row is in registers, so the
    quantiser's launch and its read of the row are saved (an FP8 projection reads it
    next: ``layers/quantization/fp8.py``).  ``x``: ``[T, H]`` with contiguous rows."""
    out = torch.empty_like(x)
    res_out = torch.empty_like(residual) if residual is not None else None
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
    _launch(x, residual, weight, eps, out, res_out, (q, scale))
    return out, res_out, q, scale


# --------------------------------------------------------------------------- Gemma


@triton.jit
def _gemma_row(x, w, mask, n_cols, eps):
    """Gemma's norm of one loaded row, in fp32 (transformers' ``Gemma3RMSNorm``:
    ``x * rsqrt(mean(x^2) + eps) * (1 + w)``, every step in fp32)."""
    xf = tl.where(mask, x.to(tl.float32), 0.0)
    var = tl.sum(xf * xf, 0) / n_cols
    return xf * tl.math.rsqrt(var + eps) * (1.0 + w.to(tl.float32))


@triton.jit
def _gemma_norm_kernel(x_ptr, res_ptr, w1_ptr, w2_ptr, out_ptr, res_out_ptr, stride_x,
                       stride_r, stride_o, stride_ro, n_cols, eps, MODE: tl.constexpr,
                       BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_trigger(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w1 = tl.load(w1_ptr + cols, mask=mask, other=0.0)  # before the wait, as above
    if MODE == 2:
        w2 = tl.load(w2_ptr + cols, mask=mask, other=0.0)
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dt = out_ptr.dtype.element_ty
    y = _gemma_row(x, w1, mask, n_cols, eps).to(dt)
    if MODE == 0:  # norm(x)
        tl.store(out_ptr + row * stride_o + cols, y, mask=mask)
    else:  # h = residual + norm(x), added in the activation dtype as the model does
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        h = (r.to(tl.float32) + y.to(tl.float32)).to(dt)
        if MODE == 1:
            tl.store(out_ptr + row * stride_o + cols, h, mask=mask)
        else:  # and the next norm of h
            tl.store(res_out_ptr + row * stride_ro + cols, h, mask=mask)
            z = _gemma_row(h, w2, mask, n_cols, eps).to(dt)
            tl.store(out_ptr + row * stride_o + cols, z, mask=mask)


def gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
               residual: torch.Tensor | None = None,
               next_weight: torch.Tensor | None = None
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gemma's (post-)norms in one launch over ``x [..., hidden]`` (last dim contiguous),
    each value rounded to ``x.dtype`` where transformers' bf16 model rounds it:

    * ``gemma_norm(x, w)`` -> ``norm_w(x)`` (the input, pre-feed-forward and q/k norms);
    * ``gemma_norm(x, w, residual)`` -> ``residual + norm_w(x)`` (a post-norm and its skip
      connection: the layer's last add);
    * ``gemma_norm(x, w, residual, w2)`` -> ``(norm_w2(h), h)`` with ``h = residual +
      norm_w(x)``: the post-attention norm, its add, and the pre-feed-forward norm.

    ``norm_w(v) = v * rsqrt(mean(v^2) + eps) * (1 + w)`` in fp32 (``w`` zero-centred, as
    Gemma checkpoints store it)."""
    x2 = _rows(x)
    n_rows, n_cols = x2.shape
    assert weight.shape == (n_cols,), (weight.shape, n_cols)
    mode = 0 if residual is None else (1 if next_weight is None else 2)
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if mode == 2 else None
    if n_rows == 0:
        return out if mode < 2 else (out, res_out)  # type: ignore[return-value]
    o2 = _rows(out)
    r2 = _rows(residual) if residual is not None else x2
    ro2 = _rows(res_out) if res_out is not None else o2
    block = triton.next_power_of_2(n_cols)
    _gemma_norm_kernel[(n_rows,)](
        x2, r2, weight, next_weight if next_weight is not None else weight, o2, ro2,
        x2.stride(0), r2.stride(0), o2.stride(0), ro2.stride(0), n_cols, eps, MODE=mode,
        BLOCK=block, num_warps=min(16, max(1, block // 256)), **pdl_launch_args(x.device))
    return out if mode < 2 else (out, res_out)  # type: ignore[return-value]
