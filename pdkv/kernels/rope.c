/* See rope.h. Separate roundings (-ffp-contract=off): x*cos, then the product with sin, then the
 * sum; the norm as pdkv_rms_norm computes it. */
#include "rope.h"

#include <math.h>
#include <string.h>

#include "norm.h"

#define MAX_HEAD_DIM 1024

void pdkv_rope_vec(const float *x, const float *c, const float *s, int d, float *o)
{
    int half = d / 2;
    for (int i = 0; i < half; i++) {
        o[i] = x[i] * c[i] + x[i + half] * s[i];
        o[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
    }
}

void pdkv_norm_rope(const float *x, ptrdiff_t x_row, int t, int heads, int d, const float *norm_w, float eps,
                    const float *cos, const float *sin, float *out)
{
    float y[MAX_HEAD_DIM];
    for (int r = 0; r < t; r++) {
        const float *c = cos + (ptrdiff_t)r * d, *s = sin + (ptrdiff_t)r * d;
        for (int h = 0; h < heads; h++) {
            const float *xh = x + (ptrdiff_t)r * x_row + (ptrdiff_t)h * d;
            float *o = out + ((ptrdiff_t)r * heads + h) * d;
            if (norm_w)
                pdkv_rms_norm(xh, 0, 0, norm_w, y, 1, 1, d, eps);
            else
                memcpy(y, xh, sizeof(float) * (size_t)d);
            pdkv_rope_vec(y, c, s, d, o);
        }
    }
}
