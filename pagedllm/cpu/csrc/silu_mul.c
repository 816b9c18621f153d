/* SiLU-and-multiply on the CPU: out[i, j] = silu(x[i, j]) * x[i, d + j], silu(g) =
 * g / (1 + exp(-g)), float32 rows (strides xs, os).  Called through ctypes by
 * pagedllm/cpu/silu_mul.py, and by decode_stack.c, which includes this file.
 *
 * exp is Cephes' single-precision polynomial (about 1 ulp) in both the 16-wide AVX-512
 * path and the scalar tail, so an element's result never depends on where it falls in
 * the row.
 */
#include <math.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define EXP_HI 88.3762626647949f
#define EXP_LO (-88.3762626647949f)
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO (-2.12194440e-4f)

static float exp_scalar(float x) {
    x = x > EXP_HI ? EXP_HI : x < EXP_LO ? EXP_LO : x;
    const float n = nearbyintf(x * LOG2E);
    const float r = (x - n * LN2_HI) - n * LN2_LO;
    float p = 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.0f;
    return ldexpf(p, (int)n);
}

#if defined(__AVX512F__)
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(LN2_HI))),
                                   _mm512_mul_ps(n, _mm512_set1_ps(LN2_LO)));
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r),
                      _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

/* Separate roundings everywhere (no contraction): the vector and scalar paths agree. */
__attribute__((optimize("fp-contract=off")))
void silu_mul(int t, int d, const float *x, long xs, float *out, long os) {
    for (int i = 0; i < t; i++) {
        const float *g = x + (long)i * xs, *u = g + d;
        float *o = out + (long)i * os;
        int j = 0;
#if defined(__AVX512F__)
        const __m512 one = _mm512_set1_ps(1.0f);
        for (; j + 16 <= d; j += 16) {
            const __m512 gv = _mm512_loadu_ps(g + j);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
            _mm512_storeu_ps(o + j, _mm512_mul_ps(s, _mm512_loadu_ps(u + j)));
        }
#endif
        for (; j < d; j++) o[j] = g[j] / (1.0f + exp_scalar(-g[j])) * u[j];
    }
}
