/* See norm.h. */
#include "norm.h"

#include <math.h>

#include "avx2.h"

#ifdef PDKV_X86

AVX2 void pdkv_rms_norm(const float *x, ptrdiff_t outer_stride, ptrdiff_t inner_stride, const float *w, float *y,
                        int outer, int inner, int dim, float eps)
{
    for (int r = 0; r < outer * inner; r++) {
        const float *xr = x + (ptrdiff_t)(r / inner) * outer_stride + (ptrdiff_t)(r % inner) * inner_stride;
        float *yr = y + (ptrdiff_t)r * dim;
        __m256 s0 = _mm256_setzero_ps(), s1 = s0;
        int i = 0;
        for (; i + 16 <= dim; i += 16) {
            __m256 a = _mm256_loadu_ps(xr + i), b = _mm256_loadu_ps(xr + i + 8);
            s0 = _mm256_fmadd_ps(a, a, s0);
            s1 = _mm256_fmadd_ps(b, b, s1);
        }
        for (; i + 8 <= dim; i += 8) {
            __m256 a = _mm256_loadu_ps(xr + i);
            s0 = _mm256_fmadd_ps(a, a, s0);
        }
        float ss = hsum(_mm256_add_ps(s0, s1));
        for (; i < dim; i++)
            ss += xr[i] * xr[i];
        float inv = 1.0f / sqrtf(ss / (float)dim + eps);
        for (i = 0; i < dim; i++)
            yr[i] = (xr[i] * inv) * w[i];
    }
}

#else

void pdkv_rms_norm(const float *x, ptrdiff_t outer_stride, ptrdiff_t inner_stride, const float *w, float *y,
                   int outer, int inner, int dim, float eps)
{
    (void)x; (void)outer_stride; (void)inner_stride; (void)w; (void)y; (void)outer; (void)inner; (void)dim;
    (void)eps;
}

#endif
