"""Varlen causal flash attention for DeepSeek MLA's expanded form (prompts and chunks):
many requests of different query and context lengths in one launch.

What it computes.  The context has been up-projected per head (``kv_b_proj``) by the
caller; the RoPE key is one vector per token, shared by every head, and is never
expanded over heads::

    q_nope [T, H, Dn]   q_pe [T, H, R]                       (the step's query tokens)
    k_nope [S, H, Dn]   v [S, H, Dv]   k_pe [S, R]           (the contexts, concatenated)
    out    [T, H, Dv]   q's dtype

    s[t, h, j] = (q_nope[t, h] . k_nope[j, h] + q_pe[t, h] . k_pe[j]) * scale
    out[t, h]  = sum_j softmax_j(s[t, h, :])[j] * v[j, h]

Request ``b`` owns query rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` (``q_len``) and
context rows ``cu_seqlens_k[b] .. cu_seqlens_k[b + 1]`` (``k_len >= q_len``; its new
tokens are the context's last ``q_len``).  Causal with a context offset (bottom-right
aligned, as FlashAttention's varlen): query ``i`` sees context positions
``0 .. k_len - q_len + i``.  A request with an empty context (``k_len == 0``) is not
this launch's: its rows are left unwritten -- so a caller may pass the step's
``query_start_loc`` unchanged and give its decodes (served elsewhere) no context.  Rows
past ``cu_seqlens_q[-1]`` are left unwritten too.

Grid (as ``paged_attention.py``'s prompt programs)::

    axis 0: query tiles.  Each request's queries are cut into tiles of BLOCK_M rows; a
            program finds its request by binary search over ``cu_seqlens_q`` with the
            "tile start" ``cu_seqlens_q[b] // BLOCK_M + b``.  The grid is the upper
            bound ``T // BLOCK_M + num_reqs``: host ints only (no device->host sync),
            surplus programs exit at once.
    axis 1: heads.  A program is BLOCK_M queries of one head; consecutive programs are
            the query tiles of one head, so a request's K / V tiles are read from L2 by
            all but the first of them.

Inside a program: online softmax in the log2 domain (scores * scale * log2(e), exp2),
fp32 accumulation, P cast to v's dtype for the P @ V product (as FlashAttention does).
The scores are two products, ``q_nope @ k_nope^T + q_pe @ k_pe^T`` (192 = 128 + 64 wide
for V2-Lite and V3): no concatenated K is built, and Dv (128) may differ from Dn + R --
which is what FlashAttention's kernels cannot take.  The key range is walked in two
loops: tiles every query of the program sees in full (no mask arithmetic), then the
tiles across the diagonal (causal mask).  Head dims that are not powers of two (the
tests' 16 / 8 / 12) are padded to ``max(16, next power of two)`` and masked (``tl.dot``
needs K >= 16).  Every row offset is int64.

Under ``TRITON_INTERPRET=1`` both products upcast to fp32 (the interpreter's bf16
``tl.dot`` returns garbage in triton 3.6; the upcast is exact, so the numerics are the
GPU's up to accumulation order).  fp32 inputs multiply in IEEE fp32, not TF32.

Inputs come from ``attention/mla_torch.py``: ``k_nope`` and ``v`` are the two halves of
one ``kv_b_proj`` GEMM's output (strided views), ``k_pe`` a strided view of the gathered
latent entries; the kernel takes token / head strides so none of them is copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The GQA kernel's helpers: the same MMA numerics, tile search and interpreter test.
from pagedllm.kernels.paged_attention import _LOG2E, _find_request, _interpreting, _mma


@triton.jit
def _load(ptrs, dim_ok, pos_ok, DIM_AXIS: tl.constexpr, PAD: tl.constexpr,
          MASK: tl.constexpr):
    """A K or V tile (dims on ``DIM_AXIS``, positions on the other), masked only where
    needed: dims where ``PAD`` (a head dim padded to a power of two), positions where
    ``MASK`` (past the context's end).  Unmasked loads vectorise without proof work."""
    if DIM_AXIS == 0:
        d_ok = dim_ok[:, None]
        p_ok = pos_ok[None, :]
    else:
        d_ok = dim_ok[None, :]
        p_ok = pos_ok[:, None]
    if PAD and MASK:
        return tl.load(ptrs, mask=d_ok & p_ok, other=0.0)
    elif PAD:
        return tl.load(ptrs, mask=d_ok, other=0.0)
    elif MASK:
        return tl.load(ptrs, mask=p_ok, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _prefill_tile(start, q_nope, q_pe, q_pos, m_i, l_i, acc, kn_ptr, kp_ptr, v_ptr,
                  k_start, k_len, stride_knt, stride_kpt, stride_vt, scale_log2, offs_n,
                  offs_dn, offs_r, offs_dv, dn_ok, r_ok, dv_ok,
                  PAD_DN: tl.constexpr, PAD_R: tl.constexpr, PAD_DV: tl.constexpr,
                  MASK: tl.constexpr, F32_DOT: tl.constexpr):
    """Context positions ``start .. start + BLOCK_N`` of the online softmax.  ``MASK``:
    the tile may cross the causal diagonal or the context's end (else every row of the
    program sees every position of it).  ``kn_ptr`` / ``v_ptr`` point at this head."""
    pos = start + offs_n
    row = (k_start + pos).to(tl.int64)
    pos_ok = pos < k_len
    k_nope = _load(kn_ptr + row[None, :] * stride_knt + offs_dn[:, None], dn_ok, pos_ok,
                   0, PAD_DN, MASK)  # [DN, BLOCK_N]
    k_pe = _load(kp_ptr + row[None, :] * stride_kpt + offs_r[:, None], r_ok, pos_ok,
                 0, PAD_R, MASK)  # [R, BLOCK_N]
    s = _mma(q_nope, k_nope, F32_DOT) + _mma(q_pe, k_pe, F32_DOT)
    s = s * scale_log2
    if MASK:
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps m = -inf; shift by 0 so exp2 gives 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load(v_ptr + row[:, None] * stride_vt + offs_dv[None, :], dv_ok, pos_ok, 1,
              PAD_DV, MASK)  # [BLOCK_N, DV]
    acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, F32_DOT)
    return m_new, l_i, acc


# num_reqs changes from step to step: not specialised on (a new variant mid-run when it
# becomes 1 or a multiple of 16 would cost a compile).
@triton.jit(do_not_specialize=["num_reqs"])
def _mla_prefill_kernel(
    qn_ptr, qp_ptr, kn_ptr, kp_ptr, v_ptr, out_ptr, cu_q_ptr, cu_k_ptr,
    scale_log2, num_reqs,
    stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_knt, stride_knh, stride_kpt,
    stride_vt, stride_vh, stride_ot, stride_oh,
    DN: tl.constexpr, R: tl.constexpr, DV: tl.constexpr, BLOCK_DN: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PAD_DN: tl.constexpr, PAD_R: tl.constexpr,
    PAD_DV: tl.constexpr, F32_DOT: tl.constexpr, WHILE_LOOP: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    req = _find_request(cu_q_ptr, tile, num_reqs, BLOCK_M)
    q_start = tl.load(cu_q_ptr + req)
    q_len = tl.load(cu_q_ptr + req + 1) - q_start
    q_tile = tile - (q_start // BLOCK_M + req)
    if q_tile * BLOCK_M >= q_len:
        return  # surplus program of the upper-bound grid
    k_start = tl.load(cu_k_ptr + req)
    k_len = tl.load(cu_k_ptr + req + 1) - k_start
    if k_len == 0:
        return  # not this launch's request (module doc)
    ctx_len = k_len - q_len

    qi = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = qi < q_len
    tok = (q_start + qi).to(tl.int64)
    q_pos = ctx_len + qi  # the last context position each row sees
    offs_dn = tl.arange(0, BLOCK_DN)
    offs_r = tl.arange(0, BLOCK_R)
    offs_dv = tl.arange(0, BLOCK_DV)
    dn_ok = offs_dn < DN
    r_ok = offs_r < R
    dv_ok = offs_dv < DV
    head64 = head.to(tl.int64)
    q_nope = tl.load(qn_ptr + tok[:, None] * stride_qnt + head64 * stride_qnh
                     + offs_dn[None, :], mask=row_ok[:, None] & dn_ok[None, :], other=0.0)
    q_pe = tl.load(qp_ptr + tok[:, None] * stride_qpt + head64 * stride_qph
                   + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    kn_head = kn_ptr + head64 * stride_knh
    v_head = v_ptr + head64 * stride_vh

    # [0, full_end): whole tiles at or below the program's first query position, seen
    # by every row; [full_end, kv_end): the tiles across the diagonal, masked.  Padding
    # rows (past q_len) attend with a zero query: finite, never stored.
    full_end = (ctx_len + q_tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N
    kv_end = ctx_len + tl.minimum(q_len, (q_tile + 1) * BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    if WHILE_LOOP:
        # The interpreter cannot take loaded scalars as range() bounds (numpy 2 refuses
        # int() of their shape-(1,) arrays); on the GPU the for-loops stay, as only
        # scf.for loops are software-pipelined (num_stages).
        start = 0
        while start < full_end:
            m_i, l_i, acc = _prefill_tile(
                start, q_nope, q_pe, q_pos, m_i, l_i, acc, kn_head, kp_ptr, v_head,
                k_start, k_len, stride_knt, stride_kpt, stride_vt, scale_log2, offs_n,
                offs_dn, offs_r, offs_dv, dn_ok, r_ok, dv_ok, PAD_DN, PAD_R, PAD_DV, False,
                F32_DOT)
            start += BLOCK_N
        while start < kv_end:
            m_i, l_i, acc = _prefill_tile(
                start, q_nope, q_pe, q_pos, m_i, l_i, acc, kn_head, kp_ptr, v_head,
                k_start, k_len, stride_knt, stride_kpt, stride_vt, scale_log2, offs_n,
                offs_dn, offs_r, offs_dv, dn_ok, r_ok, dv_ok, PAD_DN, PAD_R, PAD_DV, True,
                F32_DOT)
            start += BLOCK_N
    else:
        for start in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                start, q_nope, q_pe, q_pos, m_i, l_i, acc, kn_head, kp_ptr, v_head,
                k_start, k_len, stride_knt, stride_kpt, stride_vt, scale_log2, offs_n,
                offs_dn, offs_r, offs_dv, dn_ok, r_ok, dv_ok, PAD_DN, PAD_R, PAD_DV, False,
                F32_DOT)
        for start in range(full_end, kv_end, BLOCK_N):
            m_i, l_i, acc = _prefill_tile(
                start, q_nope, q_pe, q_pos, m_i, l_i, acc, kn_head, kp_ptr, v_head,
                k_start, k_len, stride_knt, stride_kpt, stride_vt, scale_log2, offs_n,
                offs_dn, offs_r, offs_dv, dn_ok, r_ok, dv_ok, PAD_DN, PAD_R, PAD_DV, True,
                F32_DOT)

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head64 * stride_oh + offs_dv[None, :],
             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])


@dataclass(frozen=True)
class MlaPrefillLaunch:
    """Host-side launch plan (:func:`plan_mla_prefill`, or by hand in tests and sweeps)."""

    block_m: int  # query rows per program (power of two, >= 16)
    block_n: int  # context positions per inner-loop step (power of two, >= 16)
    num_warps: int = 4
    num_stages: int = 2


def plan_mla_prefill(*, qk_nope_head_dim: int, v_head_dim: int) -> MlaPrefillLaunch:
    """The default plan: 64 x 64 tiles, 4 warps, 2 stages -- the FlashAttention-2 Triton
    shape for head dims up to 128; not yet timed (no GPU has run it: the next GPU
    session sweeps it).  At V2-Lite / V3's dims (Dn 128, R 64, Dv 128, bf16) it compiles
    for sm_90 in 196 registers, no spills, 104 KB of shared memory: two programs per
    multiprocessor (``tests/kernels/test_mla_prefill.py``).  Also spill-free there, for
    the sweep: 64 x 64 at 3 stages (144 KB), 128 x 64 at 8 warps (191 registers, 128 /
    168 KB at 2 / 3 stages), 64 x 32 at 3 stages (175 registers, 84 KB), 128 x 32 at 8
    warps and 3 stages (150, 108 KB), 64 x 128 at 8 warps (216, 184 KB).  Wider heads
    get 8 warps so the 64 x Dv fp32 accumulator stays at 64 registers a thread (not
    compiled or measured)."""
    warps = 4 if max(qk_nope_head_dim, v_head_dim) <= 128 else 8
    return MlaPrefillLaunch(block_m=64, block_n=64, num_warps=warps, num_stages=2)


def _block(d: int) -> int:
    """A head dim's padded tile width: ``tl.dot`` needs K (and N) >= 16 on the GPU."""
    return max(16, triton.next_power_of_2(d))


def mla_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, k_nope: torch.Tensor,
                k_pe: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor, scale: float, *,
                launch: MlaPrefillLaunch | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen causal MLA attention in the expanded form (module doc) -> ``out [T, H, Dv]``
    in ``q_nope``'s dtype.

    ``q_nope [T, H, Dn]``, ``q_pe [T, H, R]``, ``k_nope [S, H, Dn]``, ``v [S, H, Dv]``,
    ``k_pe [S, R]``: one dtype (fp32, bf16 or fp16), any token / head strides, last dim
    contiguous.  ``cu_seqlens_q`` / ``cu_seqlens_k`` ``[num_reqs + 1]`` int32 on q's
    device, non-decreasing, ``cu_seqlens_q[-1] <= T`` and ``cu_seqlens_k[-1] <= S``;
    every request with a context has ``k_len >= q_len`` (unchecked: reading them would
    sync the device).  ``scale``: the softmax scale.  ``launch``: a plan by hand (else
    :func:`plan_mla_prefill`); ``out``: a preallocated ``[T, H, Dv]`` (token / head
    strides free, last dim contiguous) whose rows of skipped requests and padding stay
    as they were."""
    t, h, dn = q_nope.shape
    s, r = k_pe.shape
    dv = v.shape[-1]
    if (q_pe.dim() != 3 or q_pe.shape[:2] != (t, h) or q_pe.shape[2] != r
            or k_nope.shape != (s, h, dn) or v.dim() != 3 or v.shape[:2] != (s, h)):
        raise ValueError(f"mla_prefill: q_nope {tuple(q_nope.shape)}, q_pe "
                         f"{tuple(q_pe.shape)}, k_nope {tuple(k_nope.shape)}, k_pe "
                         f"{tuple(k_pe.shape)}, v {tuple(v.shape)}: expected [T, H, Dn], "
                         "[T, H, R], [S, H, Dn], [S, R], [S, H, Dv]")
    tensors = (q_nope, q_pe, k_nope, k_pe, v)
    if any(x.dtype != q_nope.dtype for x in tensors):
        raise ValueError("mla_prefill: q_nope, q_pe, k_nope, k_pe and v must share one "
                         f"dtype, got {[str(x.dtype) for x in tensors]}")
    if any(x.stride(-1) != 1 for x in tensors):
        raise ValueError("mla_prefill: every input needs a contiguous last dim")
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32 \
            or cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError("mla_prefill: cu_seqlens_q and cu_seqlens_k must be int32 "
                         "[num_reqs + 1]")
    if out is None:
        out = torch.empty(t, h, dv, dtype=q_nope.dtype, device=q_nope.device)
    elif out.shape != (t, h, dv) or out.stride(-1) != 1:
        raise ValueError(f"mla_prefill: out {tuple(out.shape)} must be [T, H, Dv] with a "
                         "contiguous last dim")
    num_reqs = cu_seqlens_q.shape[0] - 1
    if t == 0 or s == 0 or num_reqs <= 0:
        return out
    if launch is None:
        launch = plan_mla_prefill(qk_nope_head_dim=dn, v_head_dim=dv)
    _mla_prefill_kernel[(t // launch.block_m + num_reqs, h)](
        q_nope, q_pe, k_nope, k_pe, v, out, cu_seqlens_q, cu_seqlens_k,
        scale * _LOG2E, num_reqs,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        k_nope.stride(0), k_nope.stride(1), k_pe.stride(0), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        DN=dn, R=r, DV=dv, BLOCK_DN=_block(dn), BLOCK_R=_block(r), BLOCK_DV=_block(dv),
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, PAD_DN=_block(dn) != dn,
        PAD_R=_block(r) != r, PAD_DV=_block(dv) != dv,
        F32_DOT=_interpreting() or q_nope.dtype == torch.float32,
        WHILE_LOOP=_interpreting(), num_warps=launch.num_warps,
        num_stages=launch.num_stages)
    return out
