/* Decode-only paged attention on the CPU, fused with rotary embedding and the KV write.
 *
 * Built at first use by pagedllm/cpu/build.py (-O3 -march=native -fopenmp) and called
 * through ctypes by pagedllm/attention/cpu_decode.py, which states the contract; this
 * file keeps the layouts:
 *
 *   q        [T, Hq, D] float32, token and head strides qs, qh; rotated in place
 *   k, v     [T, Hk, D] float32, strides ks, kh and vs, vh; k is rotated on its way
 *            into the cache (k itself is left as it was)
 *   cos_sin  [P, R] float32: cos in [0, R/2), sin in [R/2, R) (neox rotation of the
 *            first R features: x1 = x[:R/2], x2 = x[R/2:R] ->
 *            (x1 cos - x2 sin, x2 cos + x1 sin)); R = 0: no rotation
 *   pos      [T] int64 positions
 *   cache    [2, NB, BS, Hk, D] float32 (keys, then values)
 *   slots    [T] int64 (block * BS + offset; < 0: not written)
 *   tables   [T, tstride] int32 block tables (token t is request t: one query each)
 *   seq_lens [T] int32, the key count of each request including the new token
 *   out      [T, Hq, D] float32, contiguous
 *
 * Query head h reads KV head h / (Hq / Hk) (GQA).  With window W > 0 a query sees the
 * keys at positions >= seq_len - W only; with softcap c > 0 a score s becomes
 * c * tanh(s / c) (both as the torch reference does).  Scores are computed into a
 * per-(token, KV head) buffer, then one exact softmax (max-subtracted) and the weighted
 * sum of values (exp from vexp.h, about 1 ulp).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vexp.h"

/* Separate roundings, as torch computes x1 * cos - x2 * sin (no fused multiply-add).
 * dst may be src: each pair (i, i + r/2) is read before it is written. */
__attribute__((optimize("fp-contract=off")))
static void rotate(float *dst, const float *src, const float *cs, int d, int r) {
    const int h = r / 2;
    for (int i = 0; i < h; i++) {
        float x1 = src[i], x2 = src[i + h], c = cs[i], s = cs[i + h];
        float a = x1 * c, b = x2 * s, e = x2 * c, f = x1 * s;
        dst[i] = a - b;
        dst[i + h] = e + f;
    }
    for (int i = r; i < d; i++) dst[i] = src[i];
}

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static float dot(const float *a, const float *b, int d) {
#if defined(__AVX512F__)
    if (d % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < d; i += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float s = 0.f;
    for (int i = 0; i < d; i++) s += a[i] * b[i];
    return s;
}

/* o += p * v over d floats. */
static void axpy(float *o, float p, const float *v, int d) {
#if defined(__AVX512F__)
    if (d % 16 == 0) {
        const __m512 pv = _mm512_set1_ps(p);
        for (int i = 0; i < d; i += 16)
            _mm512_storeu_ps(o + i, _mm512_fmadd_ps(pv, _mm512_loadu_ps(v + i),
                                                    _mm512_loadu_ps(o + i)));
        return;
    }
#endif
    for (int i = 0; i < d; i++) o[i] += p * v[i];
}

#if defined(__AVX512F__)
/* Lane i of the result = the sum of v[i]'s 16 lanes.  Every input goes through the same
 * tree, ((e0 + e2) + (e1 + e3)) within each 128-bit lane and then (L0 + L1) + (L2 + L3)
 * over the lanes, so a key's score does not depend on its place among the 16: 45
 * instructions for 16 sums, against 8 dependent ones per sum for a reduce each. */
static inline __attribute__((always_inline)) __m512 hsum16(const __m512 *v) {
    __m512 w[8], x[4], z[2];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++)
        z[i] = _mm512_add_ps(
            _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
            _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Scores of the g query heads of qt (head stride qh) against keys [lo, n), 16 keys at a
 * time: per key and head the D / 16 products summed lane-wise in a fixed order, then the
 * 16 keys' lanes summed by hsum16 and scaled.  sc[gi * n + j] gets head gi's score of
 * key j (before any soft-cap). */
static inline __attribute__((always_inline)) void qk16(
    float *sc, const float *qt, long qh, int g, int hk, const float *kc,
    const int32_t *table, int bs, int nkv, int lo, int n, float scale, const int D) {
    const __m512 sv = _mm512_set1_ps(scale);
    for (int j0 = lo; j0 < n; j0 += 16) {
        const int m = n - j0 < 16 ? n - j0 : 16;
        const float *rows[16];
        for (int j = 0; j < m; j++) {
            const int key = j0 + j;
            rows[j] = kc + (((long)table[key / bs] * bs + key % bs) * nkv + hk) * D;
        }
        for (int gi = 0; gi < g; gi++) {
            const float *qg = qt + (long)(hk * g + gi) * qh;
            __m512 qv[D / 16], v[16];
            for (int i = 0; i < D / 16; i++) qv[i] = _mm512_loadu_ps(qg + 16 * i);
            for (int j = 0; j < 16; j++) {
                if (j >= m) {
                    v[j] = _mm512_setzero_ps();
                    continue;
                }
                __m512 a = _mm512_mul_ps(qv[0], _mm512_loadu_ps(rows[j]));
                for (int i = 1; i < D / 16; i++)
                    a = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(rows[j] + 16 * i), a);
                v[j] = a;
            }
            _mm512_mask_storeu_ps(sc + (long)gi * n + j0, (__mmask16)((1u << m) - 1),
                                  _mm512_mul_ps(hsum16(v), sv));
        }
    }
}

/* o_h = sum_j p_h[j] v_j for HC heads at once (their D / 16 sums each stay in registers
 * across keys, and each value row is loaded once for the HC heads); per head and lane
 * the keys are summed in order, as one head alone would be. */
static inline __attribute__((always_inline)) void pv_acc(
    float *const *o, const float *const *p, const float *vc, const int32_t *table, int bs,
    int nkv, int hk, int lo, int n, const int D, const int HC) {
    __m512 acc[HC][D / 16];
#pragma GCC unroll 16
    for (int h = 0; h < HC; h++)
#pragma GCC unroll 16
        for (int i = 0; i < D / 16; i++) acc[h][i] = _mm512_setzero_ps();
    for (int j0 = lo - lo % bs; j0 < n; j0 += bs) {
        const long base = (long)table[j0 / bs] * bs;
        const int a = j0 > lo ? j0 : lo, e = j0 + bs < n ? j0 + bs : n;
        for (int j = a; j < e; j++) {
            const float *vr = vc + ((base + j - j0) * nkv + hk) * D;
            __m512 vv[D / 16];
#pragma GCC unroll 16
            for (int i = 0; i < D / 16; i++) vv[i] = _mm512_loadu_ps(vr + 16 * i);
#pragma GCC unroll 16
            for (int h = 0; h < HC; h++) {
                const __m512 pj = _mm512_set1_ps(p[h][j]);
#pragma GCC unroll 16
                for (int i = 0; i < D / 16; i++)
                    acc[h][i] = _mm512_fmadd_ps(pj, vv[i], acc[h][i]);
            }
        }
    }
#pragma GCC unroll 16
    for (int h = 0; h < HC; h++)
#pragma GCC unroll 16
        for (int i = 0; i < D / 16; i++) _mm512_storeu_ps(o[h] + 16 * i, acc[h][i]);
}

/* The g heads' weighted sums, HMAX heads a pass (16 accumulators at most). */
static void pv_heads(float *out_t, const float *sc, int g, int hk, const float *vc,
                     const int32_t *table, int bs, int nkv, int lo, int n, int d) {
    for (int g0 = 0; g0 < g;) {
        const int left = g - g0, hc = d == 64 ? (left < 4 ? left : 4) : (left < 2 ? left : 2);
        float *o[4];
        const float *p[4];
        for (int h = 0; h < hc; h++) {
            o[h] = out_t + (long)(hk * g + g0 + h) * d;
            p[h] = sc + (long)(g0 + h) * n;
        }
        if (d == 64) {
            switch (hc) {
            case 4: pv_acc(o, p, vc, table, bs, nkv, hk, lo, n, 64, 4); break;
            case 3: pv_acc(o, p, vc, table, bs, nkv, hk, lo, n, 64, 3); break;
            case 2: pv_acc(o, p, vc, table, bs, nkv, hk, lo, n, 64, 2); break;
            default: pv_acc(o, p, vc, table, bs, nkv, hk, lo, n, 64, 1); break;
            }
        } else if (hc == 2) {
            pv_acc(o, p, vc, table, bs, nkv, hk, lo, n, 128, 2);
        } else {
            pv_acc(o, p, vc, table, bs, nkv, hk, lo, n, 128, 1);
        }
        g0 += hc;
    }
}
#endif

/* One (token, KV head): its G query heads against keys [lo, n). */
static void attend_one(int t, int hk, int hq, int nkv, int d, const float *q, long qs,
                       long qh,
                       const float *kc, const float *vc, int bs, const int32_t *table,
                       int lo, int n, float scale, float cap, float *out, float *sc) {
    const int g = hq / nkv;
    const float *qt = q + (long)t * qs;
#if defined(__AVX512F__)
    const int fast = (d == 64 || d == 128);
    if (d == 64) qk16(sc, qt, qh, g, hk, kc, table, bs, nkv, lo, n, scale, 64);
    if (d == 128) qk16(sc, qt, qh, g, hk, kc, table, bs, nkv, lo, n, scale, 128);
    if (fast && cap > 0.f)
        for (int gi = 0; gi < g; gi++)
            for (int j = lo; j < n; j++) {
                float *s = sc + (long)gi * n + j;
                *s = tanhf(*s / cap) * cap;
            }
#else
    const int fast = 0;
#endif
    /* Block by block: a key's row is table[j / bs] * bs + j % bs, without a division
     * per key. */
    for (int j0 = lo - lo % bs; j0 < n && !fast; j0 += bs) {
        const long base = (long)table[j0 / bs] * bs;
        const int a = j0 > lo ? j0 : lo, e = j0 + bs < n ? j0 + bs : n;
        for (int j = a; j < e; j++) {
            const float *kr = kc + ((base + j - j0) * nkv + hk) * d;
            for (int gi = 0; gi < g; gi++) {
                float s = dot(qt + (long)(hk * g + gi) * qh, kr, d) * scale;
                if (cap > 0.f) s = tanhf(s / cap) * cap;
                sc[(long)gi * n + j] = s;
            }
        }
    }
    float inv[g];
    for (int gi = 0; gi < g; gi++) {
        float *s = sc + (long)gi * n, m = -INFINITY, sum = 0.f;
        int j = lo;
#if defined(__AVX512F__)
        /* The max 16 lanes at a time (one vmaxss chain per key was a sixth of the time);
         * a NaN score is skipped either way (vmaxps returns its second operand). */
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (; j + 16 <= n; j += 16) mx = _mm512_max_ps(_mm512_loadu_ps(s + j), mx);
        m = _mm512_reduce_max_ps(mx);
#endif
        for (; j < n; j++) m = s[j] > m ? s[j] : m;
        j = lo;
#if defined(__AVX512F__)
        /* 16 exponentials at a time (vexp.h); the sum in 16 lanes, then the tail */
        const __m512 mv = _mm512_set1_ps(m);
        __m512 sv = _mm512_setzero_ps();
        for (; j + 16 <= n; j += 16) {
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
            _mm512_storeu_ps(s + j, e);
            sv = _mm512_add_ps(sv, e);
        }
        sum = _mm512_reduce_add_ps(sv);
#endif
        for (; j < n; j++) {
            s[j] = exp_scalar(s[j] - m);
            sum += s[j];
        }
        inv[gi] = 1.f / sum;
    }
#if defined(__AVX512F__)
    if (fast) pv_heads(out + (long)t * hq * d, sc, g, hk, vc, table, bs, nkv, lo, n, d);
#endif
    for (int gi = 0; gi < g && !fast; gi++) {
        float *o = out + ((long)t * hq + hk * g + gi) * d;
        const float *p = sc + (long)gi * n;
        for (int i = 0; i < d; i++) o[i] = 0.f;
        for (int j0 = lo - lo % bs; j0 < n; j0 += bs) {
            const long base = (long)table[j0 / bs] * bs;
            const int a = j0 > lo ? j0 : lo, e = j0 + bs < n ? j0 + bs : n;
            for (int j = a; j < e; j++)
                axpy(o, p[j], vc + ((base + j - j0) * nkv + hk) * d, d);
        }
    }
    for (int gi = 0; gi < g; gi++) {
        float *o = out + ((long)t * hq + hk * g + gi) * d;
        for (int i = 0; i < d; i++) o[i] *= inv[gi];
    }
}

/* Returns 0, or -1 when the scores buffer cannot be allocated (nothing attended). */
int decode_attention(int t_count, int hq, int hk, int d, int r, float *q, long qs, long qh,
                     const float *k, long ks, long kh, const float *v, long vs, long vh,
                     const float *cos_sin, const int64_t *pos, float *cache, long nb,
                     int bs, const int64_t *slots, const int32_t *tables, long tstride,
                     const int32_t *seq_lens, float scale, int window, float cap,
                     float *out, int nthreads) {
    const long plane = nb * bs * hk * d;
    float *kc = cache, *vc = cache + plane;
    /* Rotate q in place and write the rotated k and v into the cache. */
    for (int t = 0; t < t_count; t++) {
        const float *cs = r ? cos_sin + pos[t] * r : 0;
        if (r)
            for (int h = 0; h < hq; h++) {
                float *x = q + (long)t * qs + (long)h * qh;
                rotate(x, x, cs, r, r);
            }
        if (slots[t] < 0) continue;
        float *kd = kc + slots[t] * hk * d, *vd = vc + slots[t] * hk * d;
        for (int h = 0; h < hk; h++) {
            const float *ksrc = k + (long)t * ks + (long)h * kh;
            if (r)
                rotate(kd + (long)h * d, ksrc, cs, d, r);
            else
                for (int i = 0; i < d; i++) kd[(long)h * d + i] = ksrc[i];
            for (int i = 0; i < d; i++) vd[(long)h * d + i] = v[(long)t * vs + (long)h * vh + i];
        }
    }
    int max_len = 1;
    long work = 0;
    for (int t = 0; t < t_count; t++) {
        max_len = seq_lens[t] > max_len ? seq_lens[t] : max_len;
        work += seq_lens[t];
    }
    /* Below ~64K multiply-adds a fork-join costs more than it saves. */
    int threads = work * hq * d < 65536 ? 1 : nthreads;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *sc = malloc(sizeof(float) * (size_t)(hq / hk) * max_len);
        if (!sc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long i = 0; i < (long)t_count * hk; i++) {
            if (!sc) continue;
            int t = (int)(i / hk), h = (int)(i % hk), n = seq_lens[t];
            int lo = window > 0 && n > window ? n - window : 0;
            attend_one(t, h, hq, hk, d, q, qs, qh, kc, vc, bs, tables + (long)t * tstride, lo,
                       n, scale, cap, out, sc);
        }
        free(sc);
    }
    return failed ? -1 : 0;
}
