/* RMSNorm of float32 rows (CPU): y = x / sqrt(mean(x^2) + eps) * w, the sum of squares in float32
 * as torch's F.rms_norm accumulates it (to its rounding, not its bits). */
#ifndef PDKV_NORM_H
#define PDKV_NORM_H

#include <stddef.h>

/* x [outer, inner, dim] with strides (outer_stride, inner_stride, 1) in floats (a 2-D x: inner
 * 1), w [dim], y [outer, inner, dim] contiguous. */
void pdkv_rms_norm(const float *x, ptrdiff_t outer_stride, ptrdiff_t inner_stride, const float *w, float *y,
                   int outer, int inner, int dim, float eps);

#endif
