/* Small-M bfloat16 GEMMs for CPU decode steps on CPUs with AVX512-BF16:
 * y[m, o] = bf16(sum_i x[m, i] * w[o, i] (+ bias[o])), the sum in float32 (vdpbf16ps: two bf16
 * products per float lane), rounded to bfloat16 once at the end (round to nearest even, as
 * torch rounds a float to bfloat16).
 *
 * Half the bytes of a float32 weight and twice the products per instruction: a memory-bound
 * step reads the weights in half the time, a compute-bound one (32+ rows) runs ~2x the FMAs.
 * The same tiles as the float32 kernel (gemm_tile.h): each weight read once per call, and every
 * y[m, o] the same float operations whatever it is batched with. */
#ifndef PDKV_GEMM_BF16_H
#define PDKV_GEMM_BF16_H

#include <stddef.h>
#include <stdint.h>

/* 1 when this CPU has AVX-512F, AVX-512BW and AVX512-BF16; 0: callers must use another GEMM. */
int pdkv_gemm_bf16_supported(void);

/* As pdkv_gemm_small (gemm_small.h) over bfloat16 bit patterns: x [m, k] (row stride ldx),
 * w [n, k] (ldw), bias [n] or NULL, y [m, n] (ldy), strides in elements. Only valid when
 * pdkv_gemm_bf16_supported(). */
void pdkv_gemm_bf16(const uint16_t *x, ptrdiff_t ldx, const uint16_t *w, ptrdiff_t ldw,
                    const uint16_t *bias, uint16_t *y, ptrdiff_t ldy, int m, int k, int n);

#endif
