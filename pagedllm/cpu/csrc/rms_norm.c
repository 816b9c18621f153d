/* RMSNorm on the CPU, optionally fused with the residual add (layers/norm.py's contract):
 *
 *   s = x + r (when r is given; written to sum_out), else s = x
 *   out = w * s / sqrt(mean(s^2) + eps)
 *
 * float32 rows of h values (row strides xs, rs, os, ss); the mean of squares is
 * accumulated in double.  Built by pagedllm/cpu/build.py, called through ctypes by
 * pagedllm/cpu/rms_norm.py.
 */
#include <math.h>
#include <stdint.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static double sum_squares(const float *s, int h) {
    double acc = 0.0;
    int j = 0;
#if defined(__AVX512F__)
    __m512d a = _mm512_setzero_pd();
    for (; j + 8 <= h; j += 8) {
        __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(s + j));
        a = _mm512_fmadd_pd(v, v, a);
    }
    acc = _mm512_reduce_add_pd(a);
#endif
    for (; j < h; j++) acc += (double)s[j] * s[j];
    return acc;
}

void rms_norm(int t, int h, const float *x, long xs, const float *r, long rs,
              const float *w, float eps, float *out, long os, float *sum_out, long ss) {
    for (int i = 0; i < t; i++) {
        const float *xi = x + (long)i * xs;
        const float *src = xi;
        if (r) {
            const float *ri = r + (long)i * rs;
            float *si = sum_out + (long)i * ss;
            for (int j = 0; j < h; j++) si[j] = xi[j] + ri[j];
            src = si;
        }
        const float inv = (float)(1.0 / sqrt(sum_squares(src, h) / h + eps));
        float *oi = out + (long)i * os;
        for (int j = 0; j < h; j++) oi[j] = w[j] * (src[j] * inv);
    }
}
