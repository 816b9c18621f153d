/* SiLU-and-multiply on the CPU: out[i, j] = silu(x[i, j]) * x[i, d + j], silu(g) =
 * g / (1 + exp(-g)), float32 rows (strides xs, os).  Called through ctypes by
 * pagedllm/cpu/silu_mul.py, and by decode_stack.c, which includes this file.
 *
 * exp is vexp.h's (about 1 ulp; the vector path and the scalar tail agree), so an
 * element's result never depends on where it falls in the row.
 */
#include "vexp.h"

/* g / (1 + e) * u: no multiply-add to contract, so both paths round alike. */
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
