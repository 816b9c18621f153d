/* Dequantise torch's CPU packed-int4 weights (int4pack.py) into a bf16 scratch W^T.
 *
 * Built at first use by int4_dequant.py with the system C compiler (-O3 -march=native
 * -fopenmp) and called through ctypes.  For large M the engine multiplies by the scratch
 * with one oneDNN bf16 GEMM (avx512_bf16 runs ~2x the fp32 rate, and far above the int4
 * kernel, which re-dequantises every weight for every 4 rows of x).
 *
 * packed[p]: [N/64 tiles][K/2][2][32] bytes; byte j of (tile t, k) holds v[64t + j, k] in
 *            its low nibble and v[64t + 32 + j, k] in its high nibble (k's pair index k/2,
 *            parity k%2 select the 32-byte run);
 * sz[p]:     [K/g][N][2] bf16 (scale, zero);  w = sum_p (v_p - 8) * scale_p + zero_p,
 *            computed in fp32 and rounded once to bf16 (round to nearest even);
 * out:       W^T rows k = 0..K-1, row stride ldo elements, columns n0..n1-1 of W (both
 *            multiples of 64) written at out[k * ldo + (n - n0)].
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_PARTS 4

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void store_bf16_64(uint16_t *o, const float *acc) {
#if defined(__AVX512BF16__)
    for (int j = 0; j < 64; j += 32) {
        __m512bh r = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(acc + j + 16), _mm512_loadu_ps(acc + j));
        _mm512_storeu_si512((void *)(o + j), (__m512i)r);
    }
#else
    for (int j = 0; j < 64; j++) { /* round to nearest even, as cvtne2ps_pbh (finite) */
        uint32_t u;
        memcpy(&u, &acc[j], 4);
        u += 0x7FFF + ((u >> 16) & 1);
        o[j] = (uint16_t)(u >> 16);
    }
#endif
}

/* One 64-column tile, one k: acc = z + sum_p v_p * s_p (s, z for this k's group). */
static inline void tile_row(int nparts, const uint8_t *const *rows, float s[][64],
                            const float *z, float *acc) {
#if defined(__AVX512F__)
    __m512 a0 = _mm512_loadu_ps(z), a1 = _mm512_loadu_ps(z + 16);
    __m512 a2 = _mm512_loadu_ps(z + 32), a3 = _mm512_loadu_ps(z + 48);
    const __m256i m = _mm256_set1_epi8(15);
    for (int p = 0; p < nparts; p++) {
        __m256i b = _mm256_loadu_si256((const __m256i *)rows[p]);
        __m256i lo = _mm256_and_si256(b, m), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m);
#define CVT(x) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x))
        a0 = _mm512_fmadd_ps(CVT(_mm256_castsi256_si128(lo)), _mm512_loadu_ps(s[p]), a0);
        a1 = _mm512_fmadd_ps(CVT(_mm256_extracti128_si256(lo, 1)), _mm512_loadu_ps(s[p] + 16), a1);
        a2 = _mm512_fmadd_ps(CVT(_mm256_castsi256_si128(hi)), _mm512_loadu_ps(s[p] + 32), a2);
        a3 = _mm512_fmadd_ps(CVT(_mm256_extracti128_si256(hi, 1)), _mm512_loadu_ps(s[p] + 48), a3);
#undef CVT
    }
    _mm512_storeu_ps(acc, a0); _mm512_storeu_ps(acc + 16, a1);
    _mm512_storeu_ps(acc + 32, a2); _mm512_storeu_ps(acc + 48, a3);
#else
    for (int j = 0; j < 64; j++) acc[j] = z[j];
    for (int p = 0; p < nparts; p++)
        for (int j = 0; j < 32; j++) {
            acc[j] += (float)(rows[p][j] & 15) * s[p][j];
            acc[j + 32] += (float)(rows[p][j] >> 4) * s[p][j + 32];
        }
#endif
}

/* Returns 0, or -1 for arguments outside the contract (nothing written). */
int int4_dequant_t(int nparts, const uint8_t **packed, const uint16_t **sz, int n, int k,
                   int g, uint16_t *out, long ldo, int n0, int n1, int nthreads) {
    if (nparts < 1 || nparts > MAX_PARTS || n % 64 || k % 2 || g % 2 || k % g ||
        n0 % 64 || n1 % 64 || n0 < 0 || n1 > n || n0 >= n1 || ldo < n1 - n0)
        return -1;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int t = n0 / 64; t < n1 / 64; t++) {
        float s[MAX_PARTS][64], z[64], acc[64];
        const uint8_t *rows[MAX_PARTS];
        for (int kg = 0; kg < k / g; kg++) {
            /* (v - 8) * s + z = v * s + (z - 8 s): fold the offset into one bias. */
            for (int j = 0; j < 64; j++) z[j] = 0.f;
            for (int p = 0; p < nparts; p++) {
                const uint16_t *q = sz[p] + ((size_t)kg * n + (size_t)t * 64) * 2;
                for (int j = 0; j < 64; j++) {
                    float sc = bf16_to_f32(q[2 * j]);
                    s[p][j] = sc;
                    z[j] += bf16_to_f32(q[2 * j + 1]) - 8.f * sc;
                }
            }
            for (int kk = kg * g; kk < (kg + 1) * g; kk++) {
                for (int p = 0; p < nparts; p++)
                    rows[p] = packed[p] + ((size_t)t * (k / 2) + (size_t)(kk >> 1)) * 64 +
                              (kk & 1) * 32;
                tile_row(nparts, rows, s, z, acc);
                store_bf16_64(out + (size_t)kk * ldo + (size_t)t * 64 - n0, acc);
            }
        }
    }
    return 0;
}
