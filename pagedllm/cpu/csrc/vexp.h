/* exp for float32 on the CPU: Cephes' single-precision polynomial (about 1 ulp), as a
 * 16-wide AVX-512 function and a scalar one that computes the same value, so a result
 * never depends on whether an element fell in a vector or in the tail.  Included by the
 * kernels that need it (silu_mul.c, decode_attention.c).
 */
#ifndef PAGEDLLM_VEXP_H
#define PAGEDLLM_VEXP_H
#include <math.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define EXP_HI 88.3762626647949f
#define EXP_LO (-88.3762626647949f)
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693359375f
#define LN2_LO (-2.12194440e-4f)

/* Every multiply-add is an explicit fused one in both functions, so the compiler's
 * contraction choices cannot make them differ. */
static inline float exp_scalar(float x) {
    x = x > EXP_HI ? EXP_HI : x < EXP_LO ? EXP_LO : x;
    const float n = nearbyintf(x * LOG2E);
    const float r = fmaf(-n, LN2_LO, fmaf(-n, LN2_HI, x));
    float p = 1.9875691500E-4f;
    p = fmaf(p, r, 1.3981999507E-3f);
    p = fmaf(p, r, 8.3334519073E-3f);
    p = fmaf(p, r, 4.1665795894E-2f);
    p = fmaf(p, r, 1.6666665459E-1f);
    p = fmaf(p, r, 5.0000001201E-1f);
    p = fmaf(p * r, r, r) + 1.0f;
    return ldexpf(p, (int)n);
}

#if defined(__AVX512F__)
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO),
                                      _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x));
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

#endif
