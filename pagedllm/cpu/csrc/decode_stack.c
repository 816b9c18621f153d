/* A Llama-shaped decoder stack for one decode step on the CPU, in one call.
 *
 * Called through ctypes by pagedllm/models/cpu_decode_stack.py, which states when it applies.
 * It runs, for each layer, the same C kernels the per-module path calls one by one
 * (this file includes them), in the same order on the same buffers, so its result is
 * bit-identical to that path's:
 *
 *   x, res = rms_norm(hidden (+ res), ln1)     (layer 0 without a residual: res = hidden)
 *   qkv    = x Wqkv^T                          int4_vnni_gemm, per segment
 *   a      = decode_attention(q, k, v, cache)  rotary, KV write, paged attention
 *   hidden = a Wo^T
 *   x, res = rms_norm(hidden + res, ln2)
 *   hidden = silu_mul(x Wgate_up^T) Wdown^T
 *
 * and returns hidden and res (the caller applies the final norm).  What it saves is
 * Python: some 40 module calls and 7 ctypes calls per layer.
 */
#include "decode_attention.c"
#include "rms_norm.c"
#include "silu_mul.c"
#include "../../layers/quantization/csrc/int4_vnni.c"

#define MAX_SEGS 4

/* y [T, sum of n] = x [T, k] W^T, W the concatenation (along N) of nseg segments, each
 * the sum of nparts[s] int4 parts of shape [n[s], k] and group group[s], all in the
 * vnni4 layout (act8 = 0) or all in vnni4x8 (act8 = 1: int8 activations). */
typedef struct {
    int nseg, k, act8;
    int nparts[MAX_SEGS], n[MAX_SEGS], group[MAX_SEGS];
    const uint8_t *packed[MAX_SEGS][MAX_PARTS];
    const uint16_t *sz[MAX_SEGS][MAX_PARTS];
} Linear;

typedef struct {
    const float *ln1, *ln2;       /* the two RMSNorm weights [h] */
    Linear qkv, o, gate_up, down;
    float *cache;                 /* [2, nb, bs, hk, d] */
    long nb;
    int window;                   /* sliding window (0: none) */
    float softcap, scale;         /* logit soft-cap (0: none), score scale */
} Layer;

static int linear(const Linear *l, const float *x, long ldx, int t, float *y, long ldy,
                  int nthreads) {
    long col = 0;
    for (int s = 0; s < l->nseg; s++) {
        int rc = int4_vnni_gemm(l->nparts[s], l->packed[s], l->sz[s], l->n[s], l->k,
                                l->group[s], x, ldx, t, y + col, ldy, nthreads, l->act8);
        if (rc) return rc;
        col += l->n[s];
    }
    return 0;
}

/* hidden [t, h] in: the stack's input (the embeddings, or the previous stage's hidden);
 * out: the last layer's MLP output.  res [t, h]: the residual stream (read when
 * has_res, always written).  Returns 0; -1 for arguments outside a kernel's contract;
 * -2 when a buffer cannot be allocated. */
int decode_stack(int nlayers, const Layer *layers, int t, int h, int hq, int hk, int d,
                 int r, int inter, float eps, float *hidden, float *res, int has_res,
                 const float *cos_sin, const int64_t *pos, int bs, const int64_t *slots,
                 const int32_t *tables, long tstride, const int32_t *seq_lens,
                 int nthreads) {
    const long nqkv = (long)(hq + 2 * hk) * d, na = (long)hq * d;
    float *buf = malloc(sizeof(float) * (size_t)t * (h + nqkv + na + 3 * (long)inter));
    if (!buf) return -2;
    float *x = buf, *qkv = x + (long)t * h, *a = qkv + (long)t * nqkv,
          *gu = a + (long)t * na, *act = gu + (long)t * 2 * inter;
    int rc = 0;
    for (int i = 0; i < nlayers && !rc; i++) {
        const Layer *L = layers + i;
        if (i == 0 && !has_res) {
            memcpy(res, hidden, sizeof(float) * (size_t)t * h);
            rms_norm(t, h, hidden, h, 0, 0, L->ln1, eps, x, h, 0, 0);
        } else {
            rms_norm(t, h, hidden, h, res, h, L->ln1, eps, x, h, res, h);
        }
        if ((rc = linear(&L->qkv, x, h, t, qkv, nqkv, nthreads))) break;
        if (decode_attention(t, hq, hk, d, r, qkv, nqkv, d, qkv + na, nqkv, d,
                             qkv + na + (long)hk * d, nqkv, d, cos_sin, pos, L->cache, L->nb,
                             bs, slots, tables, tstride, seq_lens, L->scale, L->window,
                             L->softcap, a, nthreads)) {
            rc = -2;
            break;
        }
        if ((rc = linear(&L->o, a, na, t, hidden, h, nthreads))) break;
        rms_norm(t, h, hidden, h, res, h, L->ln2, eps, x, h, res, h);
        if ((rc = linear(&L->gate_up, x, h, t, gu, 2L * inter, nthreads))) break;
        silu_mul(t, inter, gu, 2L * inter, act, inter);
        rc = linear(&L->down, act, inter, t, hidden, h, nthreads);
    }
    free(buf);
    return rc;
}
