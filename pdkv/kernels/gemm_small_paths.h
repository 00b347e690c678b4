/* The ISA paths behind pdkv_gemm_small (gemm_small.h), each with its signature; gemm_small.c
 * picks one at run time. Internal to pdkv/kernels. */
#ifndef PDKV_GEMM_SMALL_PATHS_H
#define PDKV_GEMM_SMALL_PATHS_H

#include <stddef.h>

typedef void (*pdkv_gemm_fn)(const float *x, ptrdiff_t ldx, const float *w, ptrdiff_t ldw,
                             const float *bias, float *y, ptrdiff_t ldy, int m, int k, int n);

/* register-blocked over rows: each weight read once per call (gemm_tile.h) */
void pdkv_gemm_avx512(const float *x, ptrdiff_t ldx, const float *w, ptrdiff_t ldw, const float *bias,
                      float *y, ptrdiff_t ldy, int m, int k, int n);
void pdkv_gemm_avx2(const float *x, ptrdiff_t ldx, const float *w, ptrdiff_t ldw, const float *bias,
                    float *y, ptrdiff_t ldy, int m, int k, int n);
/* the first kernel: each weight row streamed once per pair of x rows (gemm_small.c) */
void pdkv_gemm_pairs(const float *x, ptrdiff_t ldx, const float *w, ptrdiff_t ldw, const float *bias,
                     float *y, ptrdiff_t ldy, int m, int k, int n);

#endif
