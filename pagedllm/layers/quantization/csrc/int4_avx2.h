/* The AVX2 variant of int4_vnni.c's kernels: the same layouts, the same integer sums,
 * for x86 CPUs without AVX512-VNNI (AMD Zen 1-3, Intel before Ice Lake).  Included by
 * int4_vnni.c, which states the layouts and the contract; compiled where the build
 * targets AVX2 + FMA (-march=native on such a CPU, and on every AVX-512 one, where a test
 * can select it: int4_vnni_force_avx2).
 *
 * vpdpbusd (4 u8 x s8 products summed into an int32, accumulated) becomes vpmaddubsw (2
 * products summed into an int16) + vpmaddwd with ones (2 int16 into an int32).  The int16
 * sums cannot saturate: codes are 4-bit (an 8-bit code is split into its two nibbles) and
 * x is int8 in [-127, 127], so one vpmaddubsw lane is at most 2 * 15 * 127 = 3,810 and
 * the 8 quads of a 32-column block add up to at most 30,480 < 2^15: a block's products
 * accumulate in int16 and widen once.  vpdpwssd (int16 x) becomes vpmaddwd + an add.
 * Registers hold 8 rows where AVX-512's hold 16.  The float steps are int4_vnni.c's, 8
 * lanes at a time; a row's result still depends on x's row alone.
 */
#if HAVE_AVX2

/* The sum of 32 floats in quantize_row's order (the two 16-wide halves added, then
 * GCC's _mm512_reduce_add_ps: halves of 8, of 4, then lanes 0 + 2, 1 + 3 and those two),
 * so that both instruction sets give every row the same bits. */
static inline float sum32(const float *x) {
    float v[16], w[8], u[4];
    for (int i = 0; i < 16; i++) v[i] = x[i] + x[16 + i];
    for (int i = 0; i < 8; i++) w[i] = v[8 + i] + v[i];
    for (int i = 0; i < 4; i++) u[i] = w[4 + i] + w[i];
    return (u[0] + u[2]) + (u[1] + u[3]);
}

/* x row -> codes (int16, or int8 with a8), per-32 scales d, per-32 sums of x and 8 times
 * the codes' sum: quantize_row's arithmetic (round to nearest even) and sums. */
static void quantize_row_avx2(const float *x, int k, void *q, int a8, float *d, float *sum,
                              int32_t *qsum8) {
    const float top = a8 ? 127.f : 32767.f;
    for (int b = 0; b < k / 32; b++) {
        const float *xb = x + 32 * b;
        float amax = 0.f;
        for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float s = sum32(xb);
        const float inv = amax > 0.f ? top / amax : 0.f;
        int32_t qs = 0;
        for (int i = 0; i < 32; i++) {
            const int32_t v = (int32_t)lrintf(xb[i] * inv);
            qs += v;
            if (a8)
                ((int8_t *)q)[32 * b + i] = (int8_t)v;
            else
                ((int16_t *)q)[32 * b + i] = (int16_t)v;
        }
        d[b] = amax / top;
        sum[b] = s;
        qsum8[b] = 8 * qs;
    }
}

static inline __attribute__((always_inline)) __m256 bf16_low(__m256i p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
}

static inline __attribute__((always_inline)) __m256 bf16_high(__m256i p) {
    return _mm256_castsi256_ps(_mm256_and_si256(p, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* acc[0 .. 8 * nr) += t * s + z * gsum for nr registers of 8 rows, (s, z) read from the
 * group's bf16 pairs at p (int4_vnni.c's group_finish). */
static inline __attribute__((always_inline)) void group_finish8(float *acc, const __m256 *t,
                                                                const uint16_t *p, int nr,
                                                                float gsum) {
    const __m256 g = _mm256_set1_ps(gsum);
    for (int r = 0; r < nr; r++) {
        const __m256i sz = _mm256_loadu_si256((const __m256i *)(p + 16 * r));
        const __m256 v = _mm256_fmadd_ps(t[r], bf16_low(sz), _mm256_mul_ps(bf16_high(sz), g));
        _mm256_storeu_ps(acc + 8 * r, _mm256_add_ps(_mm256_loadu_ps(acc + 8 * r), v));
    }
}

/* t += (ia - off) * d, int4_vnni.c's block_step. */
static inline __attribute__((always_inline)) __m256 block_step8(__m256i ia, int32_t off,
                                                                float d, __m256 t) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(ia, _mm256_set1_epi32(off))),
                           _mm256_set1_ps(d), t);
}

/* unit_rows for AVX2: one 32-row unit of one vnni4 / vnni4x8 part.  Register r of a row
 * holds weight rows 8r .. 8r + 7 of the unit: r = 0, 1 the low nibbles (rows 0-15), 2, 3
 * the high ones. */
static inline __attribute__((always_inline)) void unit_rows_avx2(
    const uint8_t *w, const uint16_t *sz, int n, int k, int g, int u, const XRows *xr,
    int m0, int mb, float acc[MB][32], const int a8) {
    const int16_t *xq = (const int16_t *)xr->q;
    const int8_t *xq1 = (const int8_t *)xr->q;
    const __m256i mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int grp = 0; grp < k / g; grp++) {
        __m256 t[MB][4];
        float gsum[MB];
        for (int m = 0; m < mb; m++) {
            for (int r = 0; r < 4; r++) t[m][r] = _mm256_setzero_ps();
            gsum[m] = 0.f;
        }
        for (int b = grp * g / 32; b < (grp + 1) * g / 32; b++) {
            __m256i ia[MB][4];
            for (int m = 0; m < mb; m++)
                for (int r = 0; r < 4; r++) ia[m][r] = _mm256_setzero_si256();
            if (a8) { /* quad q: bytes 4i + j, rows i (low nibble) and 16 + i (high) */
#pragma GCC unroll 8
                for (int q = 8 * b; q < 8 * b + 8; q++) {
                    const uint8_t *cq = w + ((size_t)u * (k / 4) + q) * 64;
                    const __m256i w0 = _mm256_loadu_si256((const __m256i *)cq);
                    const __m256i w1 = _mm256_loadu_si256((const __m256i *)(cq + 32));
                    const __m256i c[4] = {
                        _mm256_and_si256(w0, mask), _mm256_and_si256(w1, mask),
                        _mm256_and_si256(_mm256_srli_epi16(w0, 4), mask),
                        _mm256_and_si256(_mm256_srli_epi16(w1, 4), mask)};
                    for (int m = 0; m < mb; m++) {
                        int32_t xv;
                        memcpy(&xv, xq1 + (size_t)(m0 + m) * k + 4 * q, 4);
                        const __m256i xb = _mm256_set1_epi32(xv);
                        for (int r = 0; r < 4; r++) /* int16 sums: see the file's head */
                            ia[m][r] = _mm256_add_epi16(ia[m][r],
                                                        _mm256_maddubs_epi16(c[r], xb));
                    }
                }
                for (int m = 0; m < mb; m++)
                    for (int r = 0; r < 4; r++) ia[m][r] = _mm256_madd_epi16(ia[m][r], ones);
            } else { /* vnni4: per half h, bytes 2i + j of rows i and 16 + i, k = 4q + 2h + j */
                for (int q = 8 * b; q < 8 * b + 8; q++)
                    for (int h = 0; h < 2; h++) {
                        const __m256i bv = _mm256_loadu_si256(
                            (const __m256i *)(w + ((size_t)u * (k / 4) + q) * 64 + 32 * h));
                        const __m256i lo = _mm256_and_si256(bv, mask);
                        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bv, 4), mask);
                        const __m256i c[4] = {
                            _mm256_cvtepu8_epi16(_mm256_castsi256_si128(lo)),
                            _mm256_cvtepu8_epi16(_mm256_extracti128_si256(lo, 1)),
                            _mm256_cvtepu8_epi16(_mm256_castsi256_si128(hi)),
                            _mm256_cvtepu8_epi16(_mm256_extracti128_si256(hi, 1))};
                        for (int m = 0; m < mb; m++) {
                            int32_t xv;
                            memcpy(&xv, xq + (size_t)(m0 + m) * k + 4 * q + 2 * h, 4);
                            const __m256i xb = _mm256_set1_epi32(xv);
                            for (int r = 0; r < 4; r++)
                                ia[m][r] = _mm256_add_epi32(ia[m][r],
                                                            _mm256_madd_epi16(c[r], xb));
                        }
                    }
            }
            for (int m = 0; m < mb; m++) {
                const size_t i = (size_t)(m0 + m) * (k / 32) + b;
                for (int r = 0; r < 4; r++)
                    t[m][r] = block_step8(ia[m][r], xr->q8[i], xr->d[i], t[m][r]);
                gsum[m] += xr->s[i];
            }
        }
        const uint16_t *p = sz + ((size_t)grp * n + (size_t)u * 32) * 2;
        for (int m = 0; m < mb; m++) group_finish8(acc[m], t[m], p, 4, gsum[m]);
    }
}

/* unit8_rows for AVX2: one 16-row unit of a vnni8 / vnni8x8 weight; register r holds
 * rows 8r .. 8r + 7.  With int8 x an 8-bit code is multiplied as its two nibbles (16 hi +
 * lo), so vpmaddubsw cannot saturate. */
static inline __attribute__((always_inline)) void unit8_rows_avx2(
    const uint8_t *w, const uint16_t *sz, int n, int k, int g, int u, const XRows *xr,
    int m0, int mb, float acc[MB][16], const int a8) {
    const int16_t *xq = (const int16_t *)xr->q;
    const int8_t *xq1 = (const int8_t *)xr->q;
    const __m256i mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int grp = 0; grp < k / g; grp++) {
        __m256 t[MB][2];
        float gsum[MB];
        for (int m = 0; m < mb; m++) {
            t[m][0] = t[m][1] = _mm256_setzero_ps();
            gsum[m] = 0.f;
        }
        for (int b = grp * g / 32; b < (grp + 1) * g / 32; b++) {
            __m256i ia[MB][2];
            if (a8) { /* quad q: bytes 4i + j hold v[i, 4q + j] */
                __m256i lo16[MB][2], hi16[MB][2];
                for (int m = 0; m < mb; m++)
                    for (int r = 0; r < 2; r++)
                        lo16[m][r] = hi16[m][r] = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int q = 8 * b; q < 8 * b + 8; q++) {
                    const uint8_t *cq = w + ((size_t)u * (k / 4) + q) * 64;
                    __m256i lo[2], hi[2];
                    for (int r = 0; r < 2; r++) {
                        const __m256i wv = _mm256_loadu_si256((const __m256i *)(cq + 32 * r));
                        lo[r] = _mm256_and_si256(wv, mask);
                        hi[r] = _mm256_and_si256(_mm256_srli_epi16(wv, 4), mask);
                    }
                    for (int m = 0; m < mb; m++) {
                        int32_t xv;
                        memcpy(&xv, xq1 + (size_t)(m0 + m) * k + 4 * q, 4);
                        const __m256i xb = _mm256_set1_epi32(xv);
                        for (int r = 0; r < 2; r++) {
                            lo16[m][r] = _mm256_add_epi16(lo16[m][r],
                                                          _mm256_maddubs_epi16(lo[r], xb));
                            hi16[m][r] = _mm256_add_epi16(hi16[m][r],
                                                          _mm256_maddubs_epi16(hi[r], xb));
                        }
                    }
                }
                for (int m = 0; m < mb; m++)
                    for (int r = 0; r < 2; r++)
                        ia[m][r] = _mm256_add_epi32(
                            _mm256_slli_epi32(_mm256_madd_epi16(hi16[m][r], ones), 4),
                            _mm256_madd_epi16(lo16[m][r], ones));
            } else { /* vnni8: pair p, bytes 2i + j hold v[i, 2p + j] */
                for (int m = 0; m < mb; m++) ia[m][0] = ia[m][1] = _mm256_setzero_si256();
                for (int p = 16 * b; p < 16 * b + 16; p++) {
                    const uint8_t *cp = w + ((size_t)u * (k / 2) + p) * 32;
                    const __m256i c[2] = {
                        _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)cp)),
                        _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(cp + 16)))};
                    for (int m = 0; m < mb; m++) {
                        int32_t xv;
                        memcpy(&xv, xq + (size_t)(m0 + m) * k + 2 * p, 4);
                        const __m256i xb = _mm256_set1_epi32(xv);
                        for (int r = 0; r < 2; r++)
                            ia[m][r] = _mm256_add_epi32(ia[m][r], _mm256_madd_epi16(c[r], xb));
                    }
                }
            }
            for (int m = 0; m < mb; m++) {
                const size_t i = (size_t)(m0 + m) * (k / 32) + b;
                /* the codes' offset 128: 16 times q8's 8 times the codes' sum */
                for (int r = 0; r < 2; r++)
                    t[m][r] = block_step8(ia[m][r], 16 * xr->q8[i], xr->d[i], t[m][r]);
                gsum[m] += xr->s[i];
            }
        }
        const uint16_t *p = sz + ((size_t)grp * n + (size_t)u * 16) * 2;
        for (int m = 0; m < mb; m++) group_finish8(acc[m], t[m], p, 2, gsum[m]);
    }
}

/* The row count and a8 as constants (the loops over m unroll), as int4_vnni.c's switch. */
static void unit_avx2(const uint8_t *w, const uint16_t *sz, int n, int k, int g, int u,
                      const XRows *xr, int m0, int mb, float acc[MB][32], int a8) {
    switch (a8 ? mb + 4 : mb) {
    case 1: unit_rows_avx2(w, sz, n, k, g, u, xr, m0, 1, acc, 0); break;
    case 2: unit_rows_avx2(w, sz, n, k, g, u, xr, m0, 2, acc, 0); break;
    case 3: unit_rows_avx2(w, sz, n, k, g, u, xr, m0, 3, acc, 0); break;
    case 4: unit_rows_avx2(w, sz, n, k, g, u, xr, m0, 4, acc, 0); break;
    case 5: unit_rows_avx2(w, sz, n, k, g, u, xr, m0, 1, acc, 1); break;
    case 6: unit_rows_avx2(w, sz, n, k, g, u, xr, m0, 2, acc, 1); break;
    case 7: unit_rows_avx2(w, sz, n, k, g, u, xr, m0, 3, acc, 1); break;
    default: unit_rows_avx2(w, sz, n, k, g, u, xr, m0, 4, acc, 1); break;
    }
}

static void unit8_avx2(const uint8_t *w, const uint16_t *sz, int n, int k, int g, int u,
                       const XRows *xr, int m0, int mb, float acc[MB][16], int a8) {
    switch (a8 ? mb + 4 : mb) {
    case 1: unit8_rows_avx2(w, sz, n, k, g, u, xr, m0, 1, acc, 0); break;
    case 2: unit8_rows_avx2(w, sz, n, k, g, u, xr, m0, 2, acc, 0); break;
    case 3: unit8_rows_avx2(w, sz, n, k, g, u, xr, m0, 3, acc, 0); break;
    case 4: unit8_rows_avx2(w, sz, n, k, g, u, xr, m0, 4, acc, 0); break;
    case 5: unit8_rows_avx2(w, sz, n, k, g, u, xr, m0, 1, acc, 1); break;
    case 6: unit8_rows_avx2(w, sz, n, k, g, u, xr, m0, 2, acc, 1); break;
    case 7: unit8_rows_avx2(w, sz, n, k, g, u, xr, m0, 3, acc, 1); break;
    default: unit8_rows_avx2(w, sz, n, k, g, u, xr, m0, 4, acc, 1); break;
    }
}

#elif HAVE_VNNI /* never called there (use_vnni() is 1): the calls need a definition */
static void quantize_row_avx2(const float *x, int k, void *q, int a8, float *d, float *sum,
                              int32_t *qsum8) {
    (void)x; (void)k; (void)q; (void)a8; (void)d; (void)sum; (void)qsum8;
}
static void unit_avx2(const uint8_t *w, const uint16_t *sz, int n, int k, int g, int u,
                      const XRows *xr, int m0, int mb, float acc[MB][32], int a8) {
    (void)w; (void)sz; (void)n; (void)k; (void)g; (void)u; (void)xr; (void)m0; (void)mb;
    (void)acc; (void)a8;
}
static void unit8_avx2(const uint8_t *w, const uint16_t *sz, int n, int k, int g, int u,
                       const XRows *xr, int m0, int mb, float acc[MB][16], int a8) {
    (void)w; (void)sz; (void)n; (void)k; (void)g; (void)u; (void)xr; (void)m0; (void)mb;
    (void)acc; (void)a8;
}
#endif
