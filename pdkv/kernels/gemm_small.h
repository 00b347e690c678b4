/* Small-M float32 GEMMs for CPU decode steps: y[m, o] = sum_i x[m, i] * w[o, i] (+ bias[o]).
 *
 * A decode step multiplies a handful of rows by each weight, so it is bound by reading the
 * weight once from memory. On the x86 VMs this project runs on, MKL's sgemv/sgemm for M <= 16
 * read a cold weight at 9-14 GB/s; one contiguous pass over each weight row (4 FMA
 * accumulators, the rows of x kept in L1) reads it at 20-25 GB/s, about a 1-thread `sum`
 * (python -m pdkv.bench kernels measures both in the same run).
 *
 * Every y[m, o] is the same sequence of float operations whatever M, the tiling or the other
 * rows are: a row's result does not depend on what it is batched with. */
#ifndef PDKV_GEMM_SMALL_H
#define PDKV_GEMM_SMALL_H

#include <stddef.h>

/* 1 when this CPU runs the AVX2+FMA kernels; 0: callers must use another GEMM. */
int pdkv_gemm_small_supported(void);

/* x [m, k] (row stride ldx), w [n, k] (row stride ldw), bias [n] or NULL, y [m, n] (row stride
 * ldy); every row's k values contiguous. Only valid when pdkv_gemm_small_supported(). */
void pdkv_gemm_small(const float *x, ptrdiff_t ldx, const float *w, ptrdiff_t ldw, const float *bias,
                     float *y, ptrdiff_t ldy, int m, int k, int n);

#endif
