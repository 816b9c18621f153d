/* CPU int4 GEMM with AVX512-VNNI: y = x (sum_p W_p)^T for packed int4 weights; on CPUs
 * without VNNI the same layouts and sums run through AVX2 (int4_avx2.h, included below).
 *
 * Built at first use by pagedllm/cpu/build.py (-O3 -march=native -fopenmp) and called
 * through ctypes by int4_vnni.py, which states the contract.  Layouts:
 *
 *   packed[p]  the "vnni4" layout of v [N, K] (codes 0..15), N % 32 == 0, K % 32 == 0:
 *              [N/32 units][K/4 quads][64 bytes]; byte 32h + 2i + j of (unit u, quad q)
 *              holds v[32u + i, 4q + 2h + j] in its low nibble and v[32u + 16 + i,
 *              4q + 2h + j] in its high nibble (h, j < 2, i < 16).  Masking, shifting
 *              and widening 32 bytes gives 16 rows x 2 consecutive k as int16 pairs:
 *              one vpdpwssd multiplies them with two int16 values of x broadcast to
 *              every row.
 *   sz[p]      [K/g][N][2] bf16 (scale s, zero z): w = (v - 8) * s + z
 *   x          [M, K] float32, row stride ldx;  y [M, N] float32, row stride ldy
 *
 * x is quantised per row and per 32 columns to int16 (d = max|x| / 32767, q = round(x /
 * d): a relative error of at most 2^-16 of the block's largest value, below bf16's
 * 2^-9).  Per row r of W and group G:
 *
 *   sum_{k in G} x_k w_rk = s_r * sum_{b in G} d_b * sum_{k in b} q_k (v_rk - 8)
 *                           + z_r * sum_{k in G} x_k
 *
 * the inner sums exact in int32 (the offset 8 taken out with the codes' own sum), the
 * rest in float32 in a fixed order: a row's result depends on x's row alone, never on M
 * or on how the work was split over threads.
 *
 * int8_vnni_gemm is the same product for one weight of 8-bit codes (a GGUF Q8_0 table,
 * which as two int4 parts would cost twice the instructions), layout "vnni8":
 *
 *   packed     [N/16 units][K/2 pairs][32 bytes]; byte 2i + j of (unit u, pair p) holds
 *              v[16u + i, 2p + j] (codes 0..255); widened, 32 bytes are 16 rows x 2 k
 *   sz         as above, with w = (v - 128) * s + z
 *
 * With act8 = 1 (GGUF weights: ggml's own arithmetic, which multiplies its 4- and 8-bit
 * blocks with int8 activations) x is quantised to int8 instead (d = max|x| / 127, a
 * relative error of at most 2^-8 of the block's largest value) and one vpdpbusd
 * multiplies 64 bytes of codes by four int8 values of x: 64 products per instruction
 * and no widening, about 1.6x the int16 path's speed.  Layouts "vnni4x8" and "vnni8x8":
 *
 *   int4       [N/32 units][K/4 quads][64 bytes]; byte 4i + j of (unit u, quad q) holds
 *              v[32u + i, 4q + j] in its low nibble and v[32u + 16 + i, 4q + j] in its
 *              high nibble (i < 16, j < 4)
 *   int8       [N/16 units][K/4 quads][64 bytes]; byte 4i + j holds v[16u + i, 4q + j]
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1 /* csrc/int4_avx2.h: the same kernels for CPUs without VNNI */
#else
#define HAVE_AVX2 0
#endif
#if HAVE_VNNI || HAVE_AVX2
#include <immintrin.h>
#endif

#define MAX_PARTS 4
#define MB 4 /* rows of x per pass over a unit's weights */

/* 1 when the kernels run here: AVX512-VNNI, else AVX2 + FMA. */
int int4_vnni_supported(void) { return HAVE_VNNI || HAVE_AVX2; }

/* Tests: run the AVX2 kernels on a VNNI CPU too (on = 1).  Returns HAVE_AVX2. */
static int force_avx2 = 0;
int int4_vnni_force_avx2(int on) {
    force_avx2 = on;
    return HAVE_AVX2;
}

#if HAVE_VNNI || HAVE_AVX2
/* Which kernels a call runs: 1 = AVX512-VNNI, 0 = AVX2. */
static int use_vnni(void) { return HAVE_VNNI && !(HAVE_AVX2 && force_avx2); }
#endif

/* Repack v [N, K] (uint8 codes, row-major) into the vnni4 layout, or vnni4x8 with act8
 * (out: N * K / 2 bytes either way). */
int int4_vnni_pack(const uint8_t *v, int n, int k, uint8_t *out, int act8) {
    if (n % 32 || k % 32) return -1;
    for (int u = 0; u < n / 32; u++)
        for (int q = 0; q < k / 4; q++) {
            uint8_t *o = out + ((size_t)u * (k / 4) + q) * 64;
            if (act8) {
                for (int i = 0; i < 16; i++)
                    for (int j = 0; j < 4; j++)
                        o[4 * i + j] = (uint8_t)((v[(size_t)(32 * u + i) * k + 4 * q + j] & 15) |
                                                 (v[(size_t)(32 * u + 16 + i) * k + 4 * q + j]
                                                  & 15) << 4);
                continue;
            }
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 16; i++)
                    for (int j = 0; j < 2; j++) {
                        const int kk = 4 * q + 2 * h + j;
                        uint8_t lo = v[(size_t)(32 * u + i) * k + kk] & 15;
                        uint8_t hi = v[(size_t)(32 * u + 16 + i) * k + kk] & 15;
                        o[32 * h + 2 * i + j] = (uint8_t)(lo | hi << 4);
                    }
        }
    return 0;
}

#if HAVE_VNNI
/* x row -> codes (int16, or int8 with a8), per-32 scales d, per-32 sums of x and of the
 * codes (times 8, the codes' offset).  The sum of x adds the block's two 16-wide halves,
 * then reduces in _mm512_reduce_add_ps's fixed order: the same for every row wherever it
 * sits. */
static void quantize_row(const float *x, int k, void *q, int a8, float *d, float *sum,
                         int32_t *qsum8) {
    const float top = a8 ? 127.f : 32767.f;
    for (int b = 0; b < k / 32; b++) {
        const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0),
                                                               _mm512_abs_ps(x1)));
        const float db = amax / top, inv = amax > 0.f ? top / amax : 0.f;
        const __m512 iv = _mm512_set1_ps(inv);
        /* cvtps rounds to nearest even, as lrintf does in the default rounding mode */
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, iv));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, iv));
        if (a8) {
            int8_t *q8 = (int8_t *)q + 32 * b;
            _mm_storeu_si128((__m128i *)q8, _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(q8 + 16), _mm512_cvtepi32_epi8(q1));
        } else {
            int16_t *q16 = (int16_t *)q + 32 * b;
            _mm256_storeu_si256((__m256i *)q16, _mm512_cvtepi32_epi16(q0));
            _mm256_storeu_si256((__m256i *)(q16 + 16), _mm512_cvtepi32_epi16(q1));
        }
        qsum8[b] = 8 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        d[b] = db;
        sum[b] = _mm512_reduce_add_ps(_mm512_add_ps(x0, x1));
    }
}

#endif

#if HAVE_VNNI || HAVE_AVX2
/* The rows of x as the kernels read them: codes q [m][k] (int16, or int8 when a8), and
 * per 32 columns the scale d, the sum s of x and 8 times the codes' sum q8 ([m][k / 32]
 * each). */
typedef struct {
    void *q;
    int a8;
    float *d, *s;
    int32_t *q8;
} XRows;

/* 0, or -2 (nothing to free) when the buffers cannot be allocated. */
static int xrows_alloc(XRows *r, int m, int k, int a8) {
    const size_t nb = (size_t)m * (k / 32);
    r->a8 = a8;
    r->q = malloc((a8 ? 1 : 2) * (size_t)m * k);
    r->d = malloc(sizeof(float) * nb * 3);
    if (!r->q || !r->d) {
        free(r->q);
        free(r->d);
        return -2;
    }
    r->s = r->d + nb;
    r->q8 = (int32_t *)(r->d + 2 * nb);
    return 0;
}

static void xrows_free(XRows *r) {
    free(r->q);
    free(r->d);
}

/* Quantise the m rows, shared out over the enclosing parallel region's threads (at 64
 * rows this was ~20% of a small projection's time on one thread); the loop's barrier
 * publishes them. */
static void quantize_row_avx2(const float *x, int k, void *q, int a8, float *d, float *sum,
                              int32_t *qsum8);

static void xrows_fill(const XRows *r, const float *x, long ldx, int m, int k, int vnni) {
#pragma omp for schedule(static)
    for (int i = 0; i < m; i++) {
        const float *xi = x + (size_t)i * ldx;
        void *q = (char *)r->q + (size_t)i * k * (r->a8 ? 1 : 2);
        const size_t o = (size_t)i * (k / 32);
#if HAVE_VNNI
        if (vnni) {
            quantize_row(xi, k, q, r->a8, r->d + o, r->s + o, r->q8 + o);
            continue;
        }
#endif
        (void)vnni;
        quantize_row_avx2(xi, k, q, r->a8, r->d + o, r->s + o, r->q8 + o);
    }
}
#endif

#include "int4_avx2.h"

#if HAVE_VNNI
/* The float steps after the integer sums, with explicit fused multiply-adds so that the
 * compiler's contraction choices cannot change them. */
static inline __attribute__((always_inline)) __m512 block_step(__m512i ia, __m512i off,
                                                               __m512 dv, __m512 t) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ia, off)), dv, t);
}

static inline __attribute__((always_inline)) __m512 group_finish(__m512 acc, __m512 t,
                                                                 __m512 s, __m512 z,
                                                                 float gsum) {
    return _mm512_add_ps(acc, _mm512_fmadd_ps(t, s, _mm512_mul_ps(z, _mm512_set1_ps(gsum))));
}

/* One 32-row unit of one part, rows [m0, m0 + mb) of x: y[m][32u + i] += ...  a8 (a
 * constant at each call, so each width compiles to its own loop): the vnni4x8 layout and
 * int8 x -- per quad one 64-byte load, a mask and a shift give 16 rows x 4 k for each
 * half of the unit, each multiplied with four int8 values of x broadcast to every row
 * (vpdpbusd: codes unsigned, x signed); else vnni4 and int16 x (vpdpwssd on widened
 * pairs). */
static inline __attribute__((always_inline)) void unit_rows(
    const uint8_t *w, const uint16_t *sz, int n, int k, int g, int u, const XRows *xr,
    int m0, int mb, float acc[MB][32], const int a8) {
    const int16_t *xq = (const int16_t *)xr->q;
    const int8_t *xq1 = (const int8_t *)xr->q;
    const float *xd = xr->d, *xs = xr->s;
    const int32_t *xq8 = xr->q8;
    const __m256i mask = _mm256_set1_epi8(15);
    const __m512i mask64 = _mm512_set1_epi8(15);
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int grp = 0; grp < k / g; grp++) {
        /* 32 (s, z) bf16 pairs -> float32 s and z - 8 s (a bf16 is a float's top half). */
        const uint16_t *p = sz + ((size_t)grp * n + (size_t)u * 32) * 2;
        const __m512i p0 = _mm512_loadu_si512((const void *)p);
        const __m512i p1 = _mm512_loadu_si512((const void *)(p + 32));
        const __m512 s0 = _mm512_castsi512_ps(_mm512_slli_epi32(p0, 16));
        const __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(p1, 16));
        const __m512 b0 = _mm512_castsi512_ps(_mm512_and_si512(p0, high));
        const __m512 b1 = _mm512_castsi512_ps(_mm512_and_si512(p1, high));
        __m512 t[MB][2];
        float gsum[MB];
        for (int m = 0; m < mb; m++) {
            t[m][0] = t[m][1] = _mm512_setzero_ps();
            gsum[m] = 0.f;
        }
        for (int b = grp * g / 32; b < (grp + 1) * g / 32; b++) {
            /* ch independent sums per row and half: vpdpwssd's latency (~5 cycles) would
             * otherwise bound one row's 16 dependent products per block. */
            const int ch = mb == 1 ? 4 : mb == 2 ? 2 : 1;
            __m512i ia[MB][4][2];
            for (int m = 0; m < mb; m++)
                for (int c = 0; c < ch; c++) ia[m][c][0] = ia[m][c][1] = _mm512_setzero_si512();
            if (a8) {
#pragma GCC unroll 8
                for (int qq = 0; qq < 8; qq++) { /* k = 4q .. 4q + 3 */
                    const int q = 8 * b + qq, c = qq % ch;
                    const __m512i wv = _mm512_loadu_si512(
                        (const void *)(w + ((size_t)u * (k / 4) + q) * 64));
                    const __m512i lo = _mm512_and_si512(wv, mask64);
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), mask64);
                    for (int m = 0; m < mb; m++) {
                        int32_t xv;
                        memcpy(&xv, xq1 + (size_t)(m0 + m) * k + 4 * q, 4);
                        const __m512i xb = _mm512_set1_epi32(xv);
                        ia[m][c][0] = _mm512_dpbusd_epi32(ia[m][c][0], lo, xb);
                        ia[m][c][1] = _mm512_dpbusd_epi32(ia[m][c][1], hi, xb);
                    }
                }
            } else {
                for (int q2 = 8 * b; q2 < 8 * b + 8; q2 += 2)
                for (int qq = 0; qq < 2; qq++) { /* constant chain indices once unrolled */
                    const int q = q2 + qq;
                    const uint8_t *cq = w + ((size_t)u * (k / 4) + q) * 64;
                    for (int h = 0; h < 2; h++) { /* k = 4q + 2h, 4q + 2h + 1 */
                        const int c = (2 * qq + h) % ch;
                        __m256i bv = _mm256_loadu_si256((const __m256i *)(cq + 32 * h));
                        __m512i lo = _mm512_cvtepu8_epi16(_mm256_and_si256(bv, mask));
                        __m512i hi = _mm512_cvtepu8_epi16(
                            _mm256_and_si256(_mm256_srli_epi16(bv, 4), mask));
                        for (int m = 0; m < mb; m++) {
                            int32_t xv;
                            memcpy(&xv, xq + (size_t)(m0 + m) * k + 4 * q + 2 * h, 4);
                            __m512i xb = _mm512_set1_epi32(xv);
                            ia[m][c][0] = _mm512_dpwssd_epi32(ia[m][c][0], lo, xb);
                            ia[m][c][1] = _mm512_dpwssd_epi32(ia[m][c][1], hi, xb);
                        }
                    }
                }
            }
            for (int m = 0; m < mb; m++)
                for (int c = 1; c < ch; c++) {
                    ia[m][0][0] = _mm512_add_epi32(ia[m][0][0], ia[m][c][0]);
                    ia[m][0][1] = _mm512_add_epi32(ia[m][0][1], ia[m][c][1]);
                }
            for (int m = 0; m < mb; m++) {
                const size_t r = (size_t)(m0 + m) * (k / 32) + b;
                const __m512 dv = _mm512_set1_ps(xd[r]);
                const __m512i off = _mm512_set1_epi32(xq8[r]);
                t[m][0] = block_step(ia[m][0][0], off, dv, t[m][0]);
                t[m][1] = block_step(ia[m][0][1], off, dv, t[m][1]);
                gsum[m] += xs[r];
            }
        }
        for (int m = 0; m < mb; m++) {
            _mm512_storeu_ps(acc[m], group_finish(_mm512_loadu_ps(acc[m]), t[m][0], s0, b0,
                                                  gsum[m]));
            _mm512_storeu_ps(acc[m] + 16, group_finish(_mm512_loadu_ps(acc[m] + 16), t[m][1],
                                                       s1, b1, gsum[m]));
        }
    }
}
#endif

/* Repack v [N, K] (uint8 codes, row-major) into the vnni8 layout, or vnni8x8 with act8
 * (out: N * K bytes either way). */
int int8_vnni_pack(const uint8_t *v, int n, int k, uint8_t *out, int act8) {
    if (n % 16 || k % 32) return -1;
    const int r = act8 ? 4 : 2; /* consecutive k per row in a run */
    for (int u = 0; u < n / 16; u++)
        for (int p = 0; p < k / r; p++)
            for (int i = 0; i < 16; i++)
                for (int j = 0; j < r; j++)
                    out[((size_t)u * (k / r) + p) * 16 * r + r * i + j] =
                        v[(size_t)(16 * u + i) * k + r * p + j];
    return 0;
}

#if HAVE_VNNI
/* One 16-row unit of an 8-bit weight, rows [m0, m0 + mb) of x: y[m][16u + i] += ...
 * a8 (a constant at each call): the vnni8x8 layout and int8 x, 64 bytes = 16 rows x 4 k
 * per vpdpbusd; else vnni8 and int16 x, 32 bytes widened = 16 rows x 2 k per vpdpwssd. */
static inline __attribute__((always_inline)) void unit8_rows(
    const uint8_t *w, const uint16_t *sz, int n, int k, int g, int u, const XRows *xr,
    int m0, int mb, float acc[MB][16], const int a8) {
    const int16_t *xq = (const int16_t *)xr->q;
    const int8_t *xq1 = (const int8_t *)xr->q;
    const float *xd = xr->d, *xs = xr->s;
    const int32_t *xq8 = xr->q8;
    const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
    for (int grp = 0; grp < k / g; grp++) {
        const __m512i p0 = _mm512_loadu_si512((const void *)(sz + ((size_t)grp * n +
                                                                    (size_t)u * 16) * 2));
        const __m512 s0 = _mm512_castsi512_ps(_mm512_slli_epi32(p0, 16));
        const __m512 b0 = _mm512_castsi512_ps(_mm512_and_si512(p0, high));
        __m512 t[MB];
        float gsum[MB];
        for (int m = 0; m < mb; m++) {
            t[m] = _mm512_setzero_ps();
            gsum[m] = 0.f;
        }
        for (int b = grp * g / 32; b < (grp + 1) * g / 32; b++) {
            const int ch = mb == 1 ? 4 : mb == 2 ? 2 : 1; /* as in unit_rows */
            __m512i ia[MB][4];
            for (int m = 0; m < mb; m++)
                for (int c = 0; c < ch; c++) ia[m][c] = _mm512_setzero_si512();
            if (a8) {
#pragma GCC unroll 8
                for (int qq = 0; qq < 8; qq++) { /* k = 4q .. 4q + 3 */
                    const int q = 8 * b + qq, c = qq % ch;
                    const __m512i wv = _mm512_loadu_si512(
                        (const void *)(w + ((size_t)u * (k / 4) + q) * 64));
                    for (int m = 0; m < mb; m++) {
                        int32_t xv;
                        memcpy(&xv, xq1 + (size_t)(m0 + m) * k + 4 * q, 4);
                        ia[m][c] = _mm512_dpbusd_epi32(ia[m][c], wv, _mm512_set1_epi32(xv));
                    }
                }
            } else {
                for (int p = 16 * b; p < 16 * b + 16; p++) { /* k = 2p, 2p + 1 */
                    const int c = p % ch;
                    const __m512i wv = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                        (const __m256i *)(w + ((size_t)u * (k / 2) + p) * 32)));
                    for (int m = 0; m < mb; m++) {
                        int32_t xv;
                        memcpy(&xv, xq + (size_t)(m0 + m) * k + 2 * p, 4);
                        ia[m][c] = _mm512_dpwssd_epi32(ia[m][c], wv, _mm512_set1_epi32(xv));
                    }
                }
            }
            for (int m = 0; m < mb; m++) {
                for (int c = 1; c < ch; c++) ia[m][0] = _mm512_add_epi32(ia[m][0], ia[m][c]);
                const size_t r = (size_t)(m0 + m) * (k / 32) + b;
                /* the codes' offset 128: 16 times xq8's 8 times the codes' sum */
                t[m] = block_step(ia[m][0], _mm512_set1_epi32(16 * xq8[r]),
                                  _mm512_set1_ps(xd[r]), t[m]);
                gsum[m] += xs[r];
            }
        }
        for (int m = 0; m < mb; m++)
            _mm512_storeu_ps(acc[m], group_finish(_mm512_loadu_ps(acc[m]), t[m], s0, b0,
                                                  gsum[m]));
    }
}
#endif


/* int8_vnni_gemm: y = x W^T for one vnni8 weight (N % 16 == 0); returns as below. */
int int8_vnni_gemm(const uint8_t *packed, const uint16_t *sz, int n, int k, int g,
                   const float *x, long ldx, int m, float *y, long ldy, int nthreads,
                   int act8) {
#if HAVE_VNNI || HAVE_AVX2
    if (n % 16 || k % 32 || g % 32 || k % g || m < 1 || ldx < k || ldy < n) return -1;
    XRows xr;
    if (xrows_alloc(&xr, m, k, act8)) return -2;
    /* As int4_vnni_gemm: one thread below ~32K weight bytes. */
    const int threads = (long)n * k * (m < 4 ? m : 4) < 32768 ? 1 : nthreads;
    const int vnni = use_vnni();
#pragma omp parallel num_threads(threads)
    {
    xrows_fill(&xr, x, ldx, m, k, vnni);
#pragma omp for schedule(static)
    for (int u = 0; u < n / 16; u++) {
        float acc[MB][16];
        for (int m0 = 0; m0 < m; m0 += MB) {
            const int mb = m - m0 < MB ? m - m0 : MB;
            memset(acc, 0, sizeof(acc));
            if (!vnni) {
                unit8_avx2(packed, sz, n, k, g, u, &xr, m0, mb, acc, act8);
                goto store8;
            }
#if HAVE_VNNI
            switch (act8 ? mb + 4 : mb) {
            case 1: unit8_rows(packed, sz, n, k, g, u, &xr, m0, 1, acc, 0); break;
            case 2: unit8_rows(packed, sz, n, k, g, u, &xr, m0, 2, acc, 0); break;
            case 3: unit8_rows(packed, sz, n, k, g, u, &xr, m0, 3, acc, 0); break;
            case 4: unit8_rows(packed, sz, n, k, g, u, &xr, m0, 4, acc, 0); break;
            case 5: unit8_rows(packed, sz, n, k, g, u, &xr, m0, 1, acc, 1); break;
            case 6: unit8_rows(packed, sz, n, k, g, u, &xr, m0, 2, acc, 1); break;
            case 7: unit8_rows(packed, sz, n, k, g, u, &xr, m0, 3, acc, 1); break;
            default: unit8_rows(packed, sz, n, k, g, u, &xr, m0, 4, acc, 1); break;
            }
#endif
        store8:
            for (int r = 0; r < mb; r++)
                memcpy(y + (size_t)(m0 + r) * ldy + (size_t)u * 16, acc[r], sizeof(float) * 16);
        }
    }
    }
    xrows_free(&xr);
    return 0;
#else
    (void)packed; (void)sz; (void)n; (void)k; (void)g; (void)x; (void)ldx; (void)m; (void)y;
    (void)ldy; (void)nthreads; (void)act8;
    return -1;
#endif
}

/* Returns 0; -1 for arguments outside the contract or a CPU with neither VNNI nor AVX2
 * (nothing written); -2 when the activation buffer cannot be allocated.  act8: the parts are in
 * the vnni4x8 layout and x is quantised to int8 (else vnni4, int16). */
int int4_vnni_gemm(int nparts, const uint8_t *const *packed, const uint16_t *const *sz,
                   int n, int k, int g, const float *x, long ldx, int m, float *y, long ldy,
                   int nthreads, int act8) {
#if HAVE_VNNI || HAVE_AVX2
    if (nparts < 1 || nparts > MAX_PARTS || n % 32 || k % 32 || g % 32 || k % g || m < 1 ||
        ldx < k || ldy < n)
        return -1;
    XRows xr;
    if (xrows_alloc(&xr, m, k, act8)) return -2;
    const int units = n / 32;
    /* A fork-join costs a few microseconds: not worth it below ~32K weight bytes. */
    const int threads = (long)n * k * (m < 4 ? m : 4) < 65536 ? 1 : nthreads;
    const int vnni = use_vnni();
#pragma omp parallel num_threads(threads)
    {
    xrows_fill(&xr, x, ldx, m, k, vnni);
#pragma omp for schedule(static)
    for (int u = 0; u < units; u++) {
        float acc[MB][32];
        for (int m0 = 0; m0 < m; m0 += MB) {
            const int mb = m - m0 < MB ? m - m0 : MB;
            memset(acc, 0, sizeof(acc));
            for (int p = 0; p < nparts; p++) {
                const uint8_t *w = packed[p];
                if (!vnni) {
                    unit_avx2(w, sz[p], n, k, g, u, &xr, m0, mb, acc, act8);
                    continue;
                }
#if HAVE_VNNI
                switch (act8 ? mb + 4 : mb) { /* constant row counts: loops over m unroll */
                case 1: unit_rows(w, sz[p], n, k, g, u, &xr, m0, 1, acc, 0); break;
                case 2: unit_rows(w, sz[p], n, k, g, u, &xr, m0, 2, acc, 0); break;
                case 3: unit_rows(w, sz[p], n, k, g, u, &xr, m0, 3, acc, 0); break;
                case 4: unit_rows(w, sz[p], n, k, g, u, &xr, m0, 4, acc, 0); break;
                case 5: unit_rows(w, sz[p], n, k, g, u, &xr, m0, 1, acc, 1); break;
                case 6: unit_rows(w, sz[p], n, k, g, u, &xr, m0, 2, acc, 1); break;
                case 7: unit_rows(w, sz[p], n, k, g, u, &xr, m0, 3, acc, 1); break;
                default: unit_rows(w, sz[p], n, k, g, u, &xr, m0, 4, acc, 1); break;
                }
#endif
            }
            for (int r = 0; r < mb; r++)
                memcpy(y + (size_t)(m0 + r) * ldy + (size_t)u * 32, acc[r], sizeof(float) * 32);
        }
    }
    }
    xrows_free(&xr);
    return 0;
#else
    (void)nparts; (void)packed; (void)sz; (void)n; (void)k; (void)g; (void)x; (void)ldx;
    (void)m; (void)y; (void)ldy; (void)nthreads; (void)act8;
    return -1;
#endif
}
