#include "fp8.h"

void pdkv_fp8_dequant(const uint8_t *w, ptrdiff_t ldw, const float *scale, ptrdiff_t lds, const float *lut,
                      float *out, ptrdiff_t ldo, int n, int k, int bn, int bk)
{
    for (int r = 0; r < n; r++) {
        const uint8_t *src = w + (ptrdiff_t)r * ldw;
        const float *s = scale + (ptrdiff_t)(r / bn) * lds;
        float *dst = out + (ptrdiff_t)r * ldo;
        for (int c0 = 0, b = 0; c0 < k; c0 += bk, b++) {
            int c1 = c0 + bk < k ? c0 + bk : k;
            float sb = s[b];
            for (int c = c0; c < c1; c++)
                dst[c] = lut[src[c]] * sb;
        }
    }
}
